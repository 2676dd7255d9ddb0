"""The weight sync's collective order, model-checked under NCCL's rules at the shipped full layouts
(TP4/PP4/EP16 and TP8/PP8/EP32 on 256 ranks), where no CPU run can go: every schedule completes,
while the funnel it replaced deadlocks already at TP2 x EP2. The checker is at least as strict as
NCCL: it refuses a collective that members reach in a different order, and a send completes only
once received (`tests/nccl_model.py`). The model's exchange is checked against real runs' traces in
`tests/test_transport_matrix.py`."""

from __future__ import annotations

import json

import pytest

from slimrl.devices.launch_plan import simulated_layout
from slimrl.devices.ledger import build_ledger
from slimrl.devices.rank_groups import Sizes
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.parallel_layout import ParallelLayout
from slimrl.planning.memory_plan import pipeline_chunks
from slimrl.preflight import load_config
from tests.conftest import REPO
from tests.nccl_model import Deadlock, Op, check, old_funnel_schedule, sync_schedule

SHIPPED = ["grpo_moe_256gpu", "deepseek_v3_256gpu"]


def stage_layers(arch, layout) -> list[list[int]]:
    """Layers of every virtual pipeline stage, as the trainer builds them."""
    chunks = pipeline_chunks(arch, layout)
    vpp = layout.vpp or 1
    return [list(chunks[stage % layout.pp][stage // layout.pp].layers) for stage in range(layout.pp * vpp)]


def moe_layers(arch) -> set[int]:
    if not arch.is_moe:
        return set()
    return {i for i in range(arch.num_layers) if not arch.moe_layer_pattern or arch.moe_layer_pattern[i]}


def senders_of(config, sizes: Sizes, transport: str) -> list[list[int]]:
    ledger = build_ledger(config, simulated_layout(config), "cuda", sizes, transport)
    per_engine: dict[int, list[int]] = {}
    for ref in ledger.references:
        engine = int(ref.receiver.split("/")[1])
        per_engine.setdefault(engine, []).append(int(ref.sender.removeprefix("trainer/")))
    return [per_engine[i] for i in sorted(per_engine)]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_shipped_layouts_sync_without_deadlock_under_nccl_rules(name, transport, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(REPO / "configs" / f"{name}.yaml")
    arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
    layout = ParallelLayout.resolve(config.parallel, 256, arch)
    sizes = Sizes.of(layout)
    assert sizes.world == 256
    # tensor: the config's own colocated engines; distributed: the same trainer beside engines
    senders = senders_of(config, sizes, "tensor") if transport == "tensor" else []
    schedule = sync_schedule(sizes, stage_layers(arch, layout), moe_layers(arch), transport, senders)
    completed = check(schedule)
    rounds = max(len(layers) for layers in stage_layers(arch, layout)) + 2
    print(f"{name} {transport}: {completed} collectives and sends in {rounds} rounds, no deadlock")
    assert completed > 256


def test_the_old_funnel_deadlocks_already_at_tp2_ep2():
    """Owners sent their buckets to rank 0 during the export, and rank 0 received them only after
    its own: rank 1, owner of its experts, waits in its send while rank 0 waits for it in the next
    layer's tensor-parallel gather. gloo's eager small sends let CPU runs finish."""
    sizes = Sizes(tp=2, pp=1, cp=1, ep=2, etp=1, dp=1)
    with pytest.raises(Deadlock) as found:
        check(old_funnel_schedule(sizes, [[0, 1]], {0, 1}))
    assert "rank 0 waits in all_gather on tensor_parallel" in str(found.value)
    assert "rank 1 waits in send to rank 0" in str(found.value)
    # ... and the rounds do not
    check(sync_schedule(sizes, [[0, 1]], {0, 1}, "distributed", []))


def test_the_checker_refuses_collectives_in_different_orders():
    both = (0, 1)
    crossed = [
        [Op("coll", "all_gather", both, "tp"), Op("coll", "broadcast", both, "world")],
        [Op("coll", "broadcast", both, "world"), Op("coll", "all_gather", both, "tp")],
    ]
    with pytest.raises(Deadlock, match="mismatch"):
        check(crossed)
    send_first = [
        [Op("send", "send", (1,)), Op("recv", "recv", (1,))],
        [Op("send", "send", (0,)), Op("recv", "recv", (0,))],
    ]
    with pytest.raises(Deadlock, match="rank 0 waits in send to rank 1"):
        check(send_first)  # eager sends (gloo) would pass this; rendezvous (NCCL) deadlocks


def trace_schedule(trace: list[list[list]]) -> list[list[Op]]:
    """Real calls (round, name, group ranks) per rank as model operations (the weight-update
    broadcast to the engines, group -1, is not the trainer's and is left out)."""
    schedule = []
    for rank, calls in enumerate(trace):
        ops = []
        for _, name, members in calls:
            if members == [-1]:
                continue
            if name in ("send", "recv"):
                ops.append(Op(name, name, (members[0],)))
            else:
                ops.append(Op("coll", name, tuple(members)))
        schedule.append(ops)
        del rank
    return schedule


def check_trace_against_model(trace: list[list[list]], sizes: Sizes) -> None:
    """A real push under NCCL's rules, and in the model's shape: in every round each rank's gathers
    are on its tensor- or expert-tensor-parallel group, before any exchange of the round."""
    check(trace_schedule(trace))
    from slimrl.devices.rank_groups import decoder_groups, expert_groups

    tp = {r: g for g in decoder_groups(sizes, ("tp",)) for r in g}
    etp = {r: g for g in expert_groups(sizes, ("tp",)) for r in g}
    for rank, calls in enumerate(trace):
        by_round: dict[int, list] = {}
        for round_index, name, members in calls:
            by_round.setdefault(round_index, []).append((name, members))
        for round_index, calls_of_round in by_round.items():
            if round_index < 0:
                continue
            gathers = [m for n, m in calls_of_round if n == "all_gather"]
            assert all(m in (tp[rank], etp[rank]) for m in gathers), (rank, round_index, gathers)
            first_exchange = next(
                (i for i, (n, _) in enumerate(calls_of_round) if n != "all_gather"), len(calls_of_round)
            )  # `disk` exchanges nothing until it finishes
            assert all(n != "all_gather" for n, _ in calls_of_round[first_exchange:]), (rank, round_index)


def load_trace(path) -> list[list[list]]:
    return json.loads(path.read_text())
