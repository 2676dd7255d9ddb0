"""The memory planner: exact against real Megatron-Core models, and the shipped big-model layouts.

`slimrl.planning.memory_plan` claims parameter counts, parameter/grad-buffer bytes that are exact
and an optimizer-state upper bound within a few percent; the slow tests build the tiny models
under several layouts on CPU (`tests/dist/param_count_worker.py`) and hold it to that. The fast
tests plan the three big GPU configs (config.json only) and check the refusals.
Run with `-s` to see the plans and the measured-vs-planned table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.megatron_bridge.megatron_config import padded_vocab_size
from slimrl.parallel_layout import ParallelLayout
from slimrl.planning.memory_plan import (
    GIB,
    MemoryPlan,
    check_fits,
    in_flight_microbatches,
    plan,
    total_parameters,
)
from slimrl.preflight import load_config
from tests.conftest import REPO, run_slimrl, run_torchrun

WORKER = REPO / "tests" / "dist" / "param_count_worker.py"
BIG_CONFIGS = {
    "qwen3_30b_a3b_8gpu": 30.53e9,
    "moonlight_16b_a3b_8gpu": 15.96e9,
    "grpo_moe_256gpu": 235.09e9,
    "deepseek_v3_256gpu": 671.03e9,
}
OPTIMIZER_SLACK = 0.03
"""The planned optimizer state is the distributed optimizer's padded shard, an upper bound: the
real shard holds only the parameter elements that fall into it."""


# --------------------------------------------------------------------- tiny models, measured
# (arch, make_tiny overrides, ranks, parallel overrides)
LAYOUTS = [
    ("qwen3_moe", {}, 2, ["parallel.tp=2"]),
    ("qwen3_moe", {}, 2, ["parallel.ep=2"]),
    ("qwen3_moe", {"num_hidden_layers": 4}, 2, ["parallel.pp=2", "parallel.pp_layout=[1,3]"]),
    ("qwen3_moe", {"num_hidden_layers": 4}, 2, ["parallel.pp=2", "parallel.vpp=2"]),
    ("qwen3_moe", {}, 4, ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"]),
    ("qwen3_moe", {}, 2, ["parallel.use_distributed_optimizer=false"]),
    ("qwen3_moe", {"tie_word_embeddings": True}, 2, ["parallel.pp=2"]),
    ("deepseek_v3", {}, 2, ["parallel.pp=2", "parallel.pp_layout=[1,2]"]),
    ("deepseek_v3", {"q_lora_rank": 16}, 4, ["parallel.tp=2", "parallel.ep=2"]),
]


def _layout_id(case) -> str:
    arch, model_overrides, _, overrides = case
    model = "".join(f"_{k}{v}" for k, v in model_overrides.items())
    return arch + model + "-" + "_".join(o.split(".")[-1].replace("=", "") for o in overrides)


def _tiny_overrides(tiny_model, case) -> list[str]:
    arch, model_overrides, nproc, overrides = case
    return [
        f"model.hf_checkpoint={tiny_model(arch, **model_overrides)}",
        f"cluster.gpus_per_node={nproc}",
        "cluster.device=cpu",
        "model.init_from_hf=false",
        "algorithm.loss=sft",
        "train.micro_batch_size=1",
        *overrides,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUTS, ids=_layout_id)
def test_planned_model_state_matches_megatron(case, tiny_model, tmp_path):
    overrides = _tiny_overrides(tiny_model, case)
    memory = plan(load_config(None, overrides), device="cpu")
    measured = run_torchrun(WORKER, case[2], overrides, tmp_path)
    print(f"\n{_layout_id(case)}: rank, pp stage, planned/measured params, grad bytes, optimizer bytes")
    for rank in measured:
        stage = memory.stages[rank["coords"]["pp"]]
        opt = rank["optimizer"]
        used = opt["adam"] + opt["main_params"]
        print(
            f"  {rank['coords']['rank']} {rank['coords']['pp']}  {stage.num_params}/{rank['num_params']}  "
            f"{stage.grads}/{rank['grad_bytes']}  {stage.optimizer}/{used} "
            f"(+{100 * (stage.optimizer - used) / stage.optimizer:.2f}%)"
        )
        assert stage.num_params == rank["num_params"]
        assert stage.grads == rank["grad_bytes"]
        # fp32 parameters: in the (padded) DDP param buffer with the distributed optimizer
        assert stage.params == (stage.grads if memory.distributed_optimizer else 4 * stage.num_params)
        assert opt["main_params"] == 0  # fp32 parameters are stepped in place: no master copy
        assert used <= stage.optimizer <= used * (1 + OPTIMIZER_SLACK), (stage.optimizer, used)


def test_tiny_counts_without_processes(tiny_model):
    """The same counts, checked by hand: tiny Qwen3-MoE, 2 layers, one rank, no padding."""
    case = ("qwen3_moe", {}, 1, ["parallel.use_distributed_optimizer=false"])
    config = load_config(None, _tiny_overrides(tiny_model, case))
    memory = plan(config, device="cpu")
    h, vocab, experts, moe_ffn, heads, groups, d = 64, 104, 4, 32, 4, 2, 16
    attention = h + (heads + 2 * groups) * d * h + 2 * d + h * heads * d
    moe = h + experts * h + experts * 3 * moe_ffn * h
    expected = 2 * vocab * h + 2 * (attention + moe) + h
    assert memory.num_params == expected == total_parameters(read_model_arch(config.model.hf_checkpoint))
    assert memory.params == memory.grads == 4 * expected
    assert memory.optimizer == 8 * expected  # Adam m and v; fp32 params need no master copy
    assert memory.allowance == 0  # no CUDA on a CPU plan


def test_vocab_padding_and_pipeline_schedule_agree_with_megatron_helpers():
    assert padded_vocab_size(129280, 8) == 129280 and padded_vocab_size(151937, 4) == 151940
    layout = ParallelLayout(world_size=4, tp=1, pp=4, cp=1, ep=1, etp=1, dp=1, vpp=2, sequence_parallel=False)
    # Megatron's interleaved warm-up on rank 0: (pp-1)*2 + (vpp-1)*pp = 10 forwards, plus one.
    assert sum(in_flight_microbatches(layout, 0)) == 11
    assert in_flight_microbatches(layout, 3) == [4, 1]
    plain = ParallelLayout(
        world_size=4, tp=1, pp=4, cp=1, ep=1, etp=1, dp=1, vpp=None, sequence_parallel=False
    )
    assert [in_flight_microbatches(plain, r) for r in range(4)] == [[4], [3], [2], [1]]


# ------------------------------------------------------------------------ big GPU configs
@pytest.fixture
def in_repo(monkeypatch):
    """The shipped configs name `configs/models/...` relative to the repository root."""
    monkeypatch.chdir(REPO)


def _big(name: str, *overrides: str) -> MemoryPlan:
    return plan(load_config(REPO / "configs" / f"{name}.yaml", list(overrides)))


@pytest.mark.parametrize("name", list(BIG_CONFIGS))
def test_shipped_big_configs_load_and_fit_80gb(name, in_repo):
    memory = _big(name)
    print(f"\n$ slimrl plan configs/{name}.yaml\n{memory.render()}")
    assert memory.device == "cuda" and memory.dtype == "bf16"
    assert memory.total_params == pytest.approx(BIG_CONFIGS[name], rel=1e-3)
    # DeepSeek-V3 runs on 141 GB GPUs for its engines' sake (docs/memory_plan.md); its trainer
    # layout would fit 80 GB ones too
    assert memory.budget == (141 if name == "deepseek_v3_256gpu" else 80) * GIB
    check_fits(memory)
    assert memory.total < 0.9 * 80 * GIB  # headroom for what the estimate misses


def test_deepseek_plan_details(in_repo):
    memory = _big("deepseek_v3_256gpu")
    stage0 = memory.stages[0]
    assert stage0.layers == tuple(range(7)) and memory.moe_layers.isdisjoint({0, 1, 2})
    assert memory.stages[-1].logits > 0 and stage0.logits == 0
    assert memory.stage_role().startswith("pipeline stage")
    # ep 32 x pp 8 of 256 ranks: no expert-data-parallel rank, so expert state is unsharded
    assert memory.layout.expert_dp == 1


def _refusal(name: str, *overrides: str) -> str:
    memory = _big(name, *overrides)
    with pytest.raises(ConfigError) as err:
        check_fits(memory)
    message = str(err.value)
    print(f"\nrefused {name} {' '.join(overrides)}:\n  {message}")
    assert "\n" not in message
    return message


def test_refuses_235b_without_model_parallel_experts(in_repo):
    message = _refusal("grpo_moe_256gpu", "parallel.ep=1", "parallel.tp=1")
    assert message.startswith("parallel.ep=1, parallel.tp=1, parallel.pp=4:")
    assert "raise parallel.ep/parallel.tp/parallel.pp" in message


def test_refuses_too_many_tokens_per_micro_batch(in_repo):
    message = _refusal("grpo_moe_256gpu", "train.max_tokens_per_gpu=1048576")
    assert message.startswith("train.max_tokens_per_gpu=1048576: activations")
    assert "lower train.max_tokens_per_gpu" in message


def test_refuses_replicated_optimizer_and_names_the_switch(in_repo):
    message = _refusal(
        "qwen3_30b_a3b_8gpu", "train.optimizer.cpu_offload=false", "parallel.use_distributed_optimizer=false"
    )
    assert message.startswith("parallel.use_distributed_optimizer=false: optimizer state")


def test_refuses_no_recompute_and_suggests_it(in_repo):
    message = _refusal("qwen3_30b_a3b_8gpu", "parallel.recompute=null")
    assert "set parallel.recompute=full" in message


def test_cpu_offload_moves_optimizer_state_to_the_host(in_repo):
    on_gpu = _big("qwen3_30b_a3b_8gpu", "parallel.tp=2", "train.optimizer.cpu_offload=false")
    offloaded = _big("qwen3_30b_a3b_8gpu", "parallel.tp=2")
    assert offloaded.optimizer == 0 < on_gpu.optimizer
    # the host holds the state (12 B per bf16 element: fp32 main + Adam) and a fp32 grad copy (4 B)
    assert offloaded.optimizer_host - on_gpu.optimizer == pytest.approx(on_gpu.optimizer / 3, rel=0.01)
    assert offloaded.total == on_gpu.total - on_gpu.optimizer


# ----------------------------------------------------------------------------------- CLI
def test_cli_plan_exit_codes():
    config = str(Path("configs") / "qwen3_30b_a3b_8gpu.yaml")
    ok = run_slimrl("plan", config, "--device", "cuda", cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert "fits" in ok.stdout and "total" in ok.stdout
    bad = run_slimrl("plan", config, "train.optimizer.cpu_offload=false", cwd=REPO)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.optimizer.cpu_offload=false" in lines[0], bad.stderr
    assert "DOES NOT FIT" in bad.stdout
