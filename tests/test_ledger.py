"""The device ledger and the GPU's rules: Megatron-Core's own rank generator as the referee of the
trainer's groups, every shipped GPU config ledgered at its full size by `--dry-run --json`, and
layouts the GPU would refuse refused at load in one line."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from slimrl.devices.launch_plan import simulated_layout
from slimrl.devices.ledger import Group, build_ledger, stand_in_uuid
from slimrl.devices.rank_groups import Sizes, decoder_groups, embedding_groups, expert_groups
from slimrl.devices.rules import GpuRuleError, check_group, check_ledger
from slimrl.preflight import load_config
from tests.conftest import REPO, run_slimrl
from tests.test_launch_plan import GPU_CONFIGS

# (tp, pp, cp, ep, etp, dp): the shipped GPU layouts and the CPU test layouts
LAYOUTS = [
    (4, 4, 1, 16, 1, 16),  # grpo_moe_256gpu
    (8, 8, 1, 32, 1, 4),  # deepseek_v3_256gpu
    (1, 1, 1, 8, 1, 8),  # qwen3_30b / moonlight, one node
    (2, 1, 1, 2, 1, 2),  # TP2 x EP2
    (1, 2, 1, 2, 1, 2),  # PP2 x EP2
    (2, 1, 1, 2, 1, 1),  # TP2, ETP1 over EP2
    (2, 2, 2, 1, 2, 2),  # context parallel
    (2, 2, 1, 2, 2, 2),
]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "tp{}pp{}cp{}ep{}etp{}dp{}".format(*s))
def test_trainer_groups_are_megatrons(sizes):
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks

    tp, pp, cp, ep, etp, dp = sizes
    s = Sizes(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp)
    order = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default, which the trainer uses
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=s.edp, pp=pp, cp=1, order=order)
    for token in ("tp", "pp", "cp", "dp", "dp-cp", "tp-pp", "tp-dp-cp"):
        assert decoder_groups(s, tuple(token.split("-"))) == decoder.get_ranks(token), token
    for token in ("tp", "ep", "dp", "tp-ep", "tp-ep-pp"):
        assert expert_groups(s, tuple(token.split("-"))) == experts.get_ranks(token), token
    assert embedding_groups(s) == [default_embedding_ranks(r) for r in decoder.get_ranks("pp")]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_gpu_config_passes_the_ledger_at_full_size(path):
    """Through the CLI, as a user on a laptop runs it: no GPU, no SGLang import, under 10 s."""
    start = time.perf_counter()
    proc = run_slimrl("train", str(path.relative_to(REPO)), "--dry-run", "--json")
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert seconds < 10, seconds
    ledger = json.loads(proc.stdout)
    config = load_config(path)
    cluster, rollout = config.cluster, config.rollout
    world = cluster.num_nodes * cluster.gpus_per_node
    processes = {p["id"]: p for p in ledger["processes"]}
    roles = Counter(p["role"] for p in ledger["processes"])
    assert roles == {"trainer": world, "engine": rollout.num_engines * rollout.gpus_per_engine}
    # every process on a real device of its node; UUIDs name devices, one per (node, GPU)
    for p in processes.values():
        assert 0 <= p["gpu"] < cluster.gpus_per_node and p["uuid"] == stand_in_uuid(p["node"], p["gpu"])
    # colocated: auto resolves to per-node references, each from the trainer rank on the engine
    # rank's own GPU; no NCCL group has two members on one GPU
    assert set(ledger["transports"].values()) == {"tensor"}
    assert len(ledger["references"]) == roles["engine"]
    for ref in ledger["references"]:
        assert processes[ref["from"]]["uuid"] == processes[ref["to"]]["uuid"] and ref["kind"] == "cuda_ipc"
    assert not [g for g in ledger["groups"] if g["purpose"] == "weight_sync"]
    for group in ledger["groups"]:
        devices = [(processes[m]["node"], processes[m]["gpu"]) for m in group["members"]]
        assert len(set(devices)) == len(devices) and group["backend"] == "nccl", group
    purposes = Counter(g["purpose"] for g in ledger["groups"])
    tp, pp, ep = config.parallel.tp, config.parallel.pp, config.parallel.ep
    assert purposes["trainer_world"] == 1
    assert purposes["tensor_parallel"] == (world // tp if tp > 1 else 0)
    assert purposes["pipeline_parallel"] == (world // pp if pp > 1 else 0)
    assert purposes["expert_parallel"] == world // ep
    assert purposes["engine_tensor_parallel"] == rollout.num_engines
    assert len(ledger["engines"]) == rollout.num_engines


def _tiny(tiny_model, *extra: str):
    return load_config(
        None,
        [f"model.hf_checkpoint={tiny_model('qwen3_moe')}", "cluster.device=cpu", "cluster.num_nodes=2",
         "cluster.gpus_per_node=4", "rollout.rollout_batch_size=8", *extra],
    )  # fmt: skip


def test_ledger_of_a_colocated_cpu_run_on_two_hosts(tiny_model):
    config = _tiny(tiny_model, "parallel.ep=2", "rollout.num_engines=4", "rollout.gpus_per_engine=2")
    from slimrl.parallel_layout import ParallelLayout

    sizes = Sizes(tp=1, pp=1, cp=1, ep=2, etp=1, dp=8)
    assert Sizes.of(ParallelLayout.resolve(config.parallel, 8, None)) == sizes
    ledger = build_ledger(config, simulated_layout(config), "cpu", sizes, "tensor")
    check_ledger(ledger)
    # the embedded engine is one process on its first slot; it maps the rank's memory there
    engines = [p for p in ledger.processes if p.role == "engine"]
    assert [(p.id, p.node, p.gpu) for p in engines] == [
        ("engine/0/tp0", "node0", 0), ("engine/1/tp0", "node0", 2),
        ("engine/2/tp0", "node1", 0), ("engine/3/tp0", "node1", 2),
    ]  # fmt: skip
    assert [(r.sender, r.receiver, r.kind) for r in ledger.references] == [
        ("trainer/0", "engine/0/tp0", "shared_memory"), ("trainer/2", "engine/1/tp0", "shared_memory"),
        ("trainer/4", "engine/2/tp0", "shared_memory"), ("trainer/6", "engine/3/tp0", "shared_memory"),
    ]  # fmt: skip
    expert = [g.members for g in ledger.groups if g.purpose == "expert_parallel"]
    assert expert == [(f"trainer/{2 * i}", f"trainer/{2 * i + 1}") for i in range(4)]
    assert ledger.to_json()["groups"][0] == {
        "purpose": "trainer_world", "backend": "gloo", "members": [f"trainer/{r}" for r in range(8)]
    }  # fmt: skip


def test_a_group_with_two_members_on_one_device_is_refused_in_one_line(tiny_model):
    config = _tiny(tiny_model)
    ledger = build_ledger(config, simulated_layout(config), "cuda", Sizes(1, 1, 1, 1, 1, 8), "distributed")
    with pytest.raises(GpuRuleError) as refused:
        check_ledger(ledger)
    line = str(refused.value)
    assert "\n" not in line
    assert "trainer/0 and engine/0/tp0 are both on node0 GPU 0 in the weight_sync group" in line
    assert "rollout.weight_sync=tensor" in line and "cluster.colocate=false" in line
    # the same rule whatever group breaks it
    with pytest.raises(GpuRuleError, match="trainer/1 and trainer/1"):
        check_group(ledger, Group("tensor_parallel", "nccl", ("trainer/1", "trainer/1")))
