"""Real multi-process Megatron-Core training on CPU (gloo) under every parallel layout we support.

Each case launches `tests/dist/layout_worker.py` under torchrun; the worker trains the tiny MoE
on a fixed batch and reports per-step losses and sha256 digests of every local parameter.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "layout_worker.py"
STEPS = 4


def train(tmp_path, tiny_model, nproc: int, *overrides: str, arch: str = "qwen3_moe", layers: int = 2):
    model = tiny_model(arch, num_hidden_layers=layers) if layers != 2 else tiny_model(arch)
    args = [
        f"model.hf_checkpoint={model}",
        f"cluster.gpus_per_node={nproc}",
        f"train.num_steps={STEPS}",
        "train.micro_batch_size=2",
        "train.optimizer.lr=3e-3",
        "algorithm.loss=sft",
        *overrides,
    ]
    name = "_".join(o.replace("parallel.", "").replace("=", "") for o in overrides) or "single"
    return run_torchrun(WORKER, nproc, args, tmp_path / name)


def losses(results) -> list[float]:
    reporting = [r for r in results if "loss" in r["metrics"][0]]
    return [m["loss"] for m in reporting[0]["metrics"]]


def grad_norms(results) -> list[float]:
    """Every rank reports the step's global gradient norm (Megatron reduces it over all ranks)."""
    norms = {tuple(m["grad_norm"] for m in r["metrics"]) for r in results}
    assert len(norms) == 1, norms
    return list(norms.pop())


def assert_equals_one_rank(results, single) -> None:
    """Same loss curve and gradient norms as one rank (the optimizer steps feed back into both)."""
    assert losses(results) == pytest.approx(losses(single), abs=1e-5)
    assert grad_norms(results) == pytest.approx(grad_norms(single), rel=1e-6, abs=1e-5)


def assert_falls(results) -> None:
    curve = losses(results)
    assert curve[-1] < curve[0] - 0.3, curve


def assert_replicas_identical(results) -> None:
    """Ranks that differ only in their data-parallel coordinate hold byte-identical weights."""
    groups = defaultdict(list)
    for r in results:
        c = r["coords"]
        groups[(c["tp"], c["pp"], c["ep"])].append(r["digests"])
    replicated = [g for g in groups.values() if len(g) > 1]
    assert replicated, "layout has no data-parallel replicas"
    for group in replicated:
        for other in group[1:]:
            assert other == group[0]


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model):
    return train(tmp_path_factory.mktemp("single"), tiny_model, 1)


def test_dp2_distributed_optimizer_equals_one_rank(tmp_path, tiny_model, single):
    results = train(tmp_path, tiny_model, 2, "parallel.use_distributed_optimizer=true")
    assert [r["coords"]["dp"] for r in results] == [0, 1]
    assert losses(results) == pytest.approx(losses(single), abs=1e-5)
    assert_falls(results)
    assert_replicas_identical(results)


def test_tp2_sequence_parallel_equals_one_rank(tmp_path, tiny_model, single):
    results = train(tmp_path, tiny_model, 2, "parallel.tp=2")
    assert [r["coords"]["tp"] for r in results] == [0, 1]
    assert losses(results) == pytest.approx(losses(single), abs=1e-5)
    assert_falls(results)


def test_pp2_one_f_one_b_with_several_microbatches(tmp_path, tiny_model, single):
    # 8 sequences, DP 1, micro-batch 2: four micro-batches through the 1F1B schedule.
    results = train(tmp_path, tiny_model, 2, "parallel.pp=2")
    assert [r["coords"]["pp"] for r in results] == [0, 1]
    assert "loss" not in results[0]["metrics"][0]  # only the last stage computes the loss
    assert losses(results) == pytest.approx(losses(single), abs=1e-5)
    assert_falls(results)


@pytest.fixture(scope="module")
def single_4_layers(tmp_path_factory, tiny_model):
    return train(tmp_path_factory.mktemp("single4"), tiny_model, 1, layers=4)


def test_pp2_virtual_stages_and_uneven_stages(tmp_path, tiny_model, single_4_layers):
    # pp2 x vpp2, one layer per virtual stage: the interleaved schedule, whose steady state sends an
    # activation and a gradient to the same peer in one call (it used to swap them, with gradient
    # norms 100x off while the loss still fell).
    interleaved = train(tmp_path, tiny_model, 2, "parallel.pp=2", "parallel.vpp=2", layers=4)
    assert [len({k.split("/")[0] for k in r["digests"]}) for r in interleaved] == [2, 2]  # 2 chunks each
    assert_equals_one_rank(interleaved, single_4_layers)
    assert_falls(interleaved)
    uneven = train(tmp_path, tiny_model, 2, "parallel.pp=2", "parallel.pp_layout=[1,3]", layers=4)
    assert_equals_one_rank(uneven, single_4_layers)
    assert_falls(uneven)
    first_stage_layers = {k.split(".")[2] for k in uneven[0]["digests"] if ".layers." in k}
    last_stage_layers = {k.split(".")[2] for k in uneven[1]["digests"] if ".layers." in k}
    assert (len(first_stage_layers), len(last_stage_layers)) == (1, 3)


def test_ep2_and_tp2_ep2_agree(tmp_path, tiny_model, single):
    ep2 = train(tmp_path, tiny_model, 2, "parallel.ep=2")
    assert losses(ep2) == pytest.approx(losses(single), abs=1e-5)
    assert [r["coords"]["ep"] for r in ep2] == [0, 1]
    experts_on = [{k for k in r["digests"] if "local_experts" in k} for r in ep2]
    assert all(len(e) == 2 * 2 * 2 for e in experts_on)  # 2 of 4 experts x 2 layers x 2 weights
    assert_falls(ep2)
    tp2ep2 = train(tmp_path, tiny_model, 4, "parallel.tp=2", "parallel.ep=2", "parallel.etp=1")
    assert losses(tp2ep2) == pytest.approx(losses(ep2), abs=1e-5)
    assert_replicas_identical(tp2ep2)
