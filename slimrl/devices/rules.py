"""The GPU's rules, checked against a ledger: on a laptop's `--dry-run`, at config load, and on
every CPU run, where gloo and shared memory would otherwise accept what NCCL and CUDA refuse.

- **One device per member** (NCCL): a communicator with two ranks on one GPU fails to form
  ("Duplicate GPU detected"); gloo accepts it.
- **References stay on their node** (CUDA IPC): a handle opens only on the node of its GPU; CPU
  shared memory of network-namespace hosts on one machine would open anywhere.

Each violation is one line naming the rule, the two processes and their devices, and what to
change; `GpuRuleError` is a `ConfigError`, so the CLI exits 2 before anything starts.
"""

from __future__ import annotations

from collections.abc import Iterable

from slimrl.devices.ledger import Group, Ledger, Process, Reference
from slimrl.errors import ConfigError

_REMEDY = {
    "weight_sync": (
        "rollout.weight_sync=distributed puts trainer rank 0 and every engine GPU in one NCCL group; "
        "colocated engines share the trainer's GPUs: use rollout.weight_sync=tensor (auto picks it "
        "when colocated), or cluster.colocate=false"
    ),
}


class GpuRuleError(ConfigError):
    """A layout the GPU would refuse."""


def where(p: Process, device: str) -> str:
    return f"{p.node} {'GPU' if device == 'cuda' else 'slot'} {p.gpu}"


def check_group(ledger: Ledger, group: Group) -> None:
    """NCCL: no two members of one communicator on one device."""
    seen: dict[tuple[str, int], Process] = {}
    for member in group.members:
        process = ledger.process(member)
        device = (process.node, process.gpu)
        if device not in seen:
            seen[device] = process
        else:
            first = seen[device]
            remedy = _REMEDY.get(group.purpose, "give every member its own device")
            raise GpuRuleError(
                f"GPU rule (NCCL, one device per group member): {first.id} and {process.id} are both on "
                f"{where(process, ledger.device)} in the {group.purpose} group; {remedy}"
            )


def check_reference(ledger: Ledger, reference: Reference) -> None:
    """CUDA IPC: the receiver maps the sender's GPU memory, so both are on one node."""
    sender, receiver = ledger.process(reference.sender), ledger.process(reference.receiver)
    if sender.node != receiver.node:
        raise GpuRuleError(
            f"GPU rule (CUDA IPC, handles open only on their own node): {receiver.id} on "
            f"{where(receiver, ledger.device)} has no trainer rank on its node to take references from "
            f"(nearest: {sender.id} on {where(sender, ledger.device)}); rollout.weight_sync=tensor needs a "
            "trainer rank on every engine node: use rollout.weight_sync=distributed (auto picks it when "
            "disaggregated) or cluster.colocate=true"
        )


def check_ledger(ledger: Ledger, groups: Iterable[Group] | None = None) -> None:
    """Every group and reference of the ledger (or only `groups`)."""
    for group in ledger.groups if groups is None else groups:
        check_group(ledger, group)
    if groups is None:
        for reference in ledger.references:
            check_reference(ledger, reference)
