"""The device ledger: every process of a run on its node and GPU, and every group or device
reference between them that the GPU cluster would have.

Built from the placement (the simulated `nodeN` layout of a config, or the placement group's real
slots), the same on GPU and CPU, so the GPU's rules (`rules.py`) can be enforced on a CPU run and
on a laptop's `--dry-run` of a 256-GPU config. Processes: every trainer rank (`trainer/R`) and
every engine TP rank (`engine/I/tpT`; the embedded engine is one process). Groups: the trainer's
(Megatron's rank arithmetic, `rank_groups.py`), each engine's own TP group, and the weight-sync
group of `distributed`. References: what `tensor` hands from a trainer rank to each engine rank
(CUDA IPC on GPUs, shared memory on CPU).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.devices.launch_plan import Slot, engine_seats, trainer_seats
from slimrl.devices.rank_groups import Sizes, trainer_groups

_UUID_NAMESPACE = uuid.UUID("6f1c4a52-52c3-4c0e-9d4e-0d6a8c1f2b7e")


def stand_in_uuid(node: str, gpu: int) -> str:
    """A stable GPU UUID for a device that has none (CPU slots, a simulated layout), in NVIDIA's
    `GPU-xxxxxxxx-...` form, distinct per (node, device)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{gpu}')}"


@dataclass(frozen=True, slots=True)
class Process:
    id: str
    role: str
    node: str
    gpu: int
    uuid: str


@dataclass(frozen=True, slots=True)
class Group:
    purpose: str
    backend: str
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reference:
    """A device reference `sender` hands `receiver`: the receiver maps the sender's memory."""

    sender: str
    receiver: str
    kind: str


@dataclass(frozen=True)
class Ledger:
    device: str
    simulated: bool
    processes: tuple[Process, ...]
    groups: tuple[Group, ...]
    references: tuple[Reference, ...]
    transports: Mapping[str, str]
    _by_id: dict[str, Process] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_id.update({p.id: p for p in self.processes})

    def process(self, process_id: str) -> Process:
        return self._by_id[process_id]

    def engine_ranks(self, index: int) -> list[Process]:
        prefix = f"engine/{index}/"
        return [p for p in self.processes if p.id.startswith(prefix)]

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "simulated": self.simulated,
            "processes": [asdict(p) for p in self.processes],
            "groups": [{**asdict(g), "members": list(g.members)} for g in self.groups],
            "references": [{"from": r.sender, "to": r.receiver, "kind": r.kind} for r in self.references],
            "transports": dict(self.transports),
        }


def engine_tp_size(config: SlimConfig) -> int:
    """Processes per engine: SGLang runs one per GPU; the embedded engine is one process."""
    return config.rollout.gpus_per_engine if config.rollout.engine == "sglang" else 1


def build_ledger(
    config: SlimConfig,
    layout: Sequence[Slot],
    device: str,
    sizes: Sizes,
    transport: str | None,
    uuids: Mapping[tuple[str, int], str] | None = None,
) -> Ledger:
    """The ledger of `config` placed on `layout`; `transport` None: no engines (SFT). `uuids` maps
    (node, device) to the GPU's own UUID; without it every device gets `stand_in_uuid`."""

    def uuid_of(node: str, gpu: int) -> str:
        return (uuids or {}).get((node, gpu)) or stand_in_uuid(node, gpu)

    backend = "nccl" if device == "cuda" else "gloo"
    trainers = [
        Process(f"trainer/{s.rank}", "trainer", s.node, s.device, uuid_of(s.node, s.device))
        for s in trainer_seats(config, layout, device)
    ]
    groups = [Group("trainer_world", backend, tuple(p.id for p in trainers))] if len(trainers) > 1 else []
    for purpose, rank_lists in trainer_groups(sizes).items():
        groups += [Group(purpose, backend, tuple(f"trainer/{r}" for r in ranks)) for ranks in rank_lists]
    engines: list[Process] = []
    references: list[Reference] = []
    transports: dict[str, str] = {}
    if transport is not None:
        per_engine = engine_tp_size(config)
        for seat in engine_seats(config, layout, device):
            ranks = [
                Process(f"engine/{seat.index}/tp{t}", "engine", seat.node, seat.devices[t],
                        uuid_of(seat.node, seat.devices[t]))
                for t in range(per_engine)
            ]  # fmt: skip
            engines += ranks
            transports[f"engine/{seat.index}"] = transport
            if len(ranks) > 1:
                groups.append(Group("engine_tensor_parallel", backend, tuple(p.id for p in ranks)))
            if transport == "tensor":
                kind = "cuda_ipc" if device == "cuda" else "shared_memory"
                references += [Reference(reference_sender(trainers, r).id, r.id, kind) for r in ranks]
        if transport == "distributed":
            groups.append(Group("weight_sync", backend, (trainers[0].id, *(p.id for p in engines))))
    return Ledger(
        device=device,
        simulated=uuids is None,
        processes=(*trainers, *engines),
        groups=tuple(groups),
        references=tuple(references),
        transports=transports,
    )


def reference_sender(trainers: Sequence[Process], receiver: Process) -> Process:
    """The trainer rank that hands `receiver` its references: the one on its GPU (colocated), else
    the first on its node, else trainer 0 (which the node rule then refuses)."""
    same_node = [p for p in trainers if p.node == receiver.node]
    same_gpu = [p for p in same_node if p.gpu == receiver.gpu]
    return (same_gpu or same_node or list(trainers))[0]
