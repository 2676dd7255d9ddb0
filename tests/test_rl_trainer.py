"""The RL trainer on real multi-process Megatron-Core (CPU, gloo): exact train/rollout agreement,
layout- and micro-batching-invariant updates, byte-exact offload, the policy moving the right way."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "rl_worker.py"


def run(tmp_path, tiny_model, scenario, nproc=1, *overrides, layers=2):
    model = tiny_model("qwen3_moe", num_hidden_layers=layers) if layers != 2 else tiny_model("qwen3_moe")
    args = [
        scenario,
        f"model.hf_checkpoint={model}",
        f"cluster.gpus_per_node={nproc}",
        "train.optimizer.lr=1e-3",
        *overrides,
    ]
    name = "_".join([scenario, *(o.split(".")[-1].replace("=", "") for o in overrides)])
    results = run_torchrun(WORKER, nproc, args, tmp_path / name)
    weights = torch.load(tmp_path / name / "weights.pt")
    return results, weights


def last_stage(results):
    return next(r for r in results if "train/pg_loss" in r["metrics"][0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model):
    return run(tmp_path_factory.mktemp("ref"), tiny_model, "steps", 1, "train.max_tokens_per_gpu=40")


def test_on_policy_step_is_exact_and_moves_the_policy(reference):
    results, _ = reference
    first, second = last_stage(results)["metrics"]
    # Rollout logprobs came from the same trainer computation: the mismatch is exactly zero.
    assert first["train/train_rollout_logprob_abs_diff"] == 0.0
    assert first["train/train_rollout_kl"] == 0.0
    assert first["train/ppo_kl"] == 0.0 and first["train/clipfrac"] == 0.0
    assert second["train/train_rollout_logprob_abs_diff"] > 0.0  # the update changed the policy
    before = last_stage(results)["rollout_logprobs"]
    after = last_stage(results)["after_logprobs"]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    for sample, values in before.items():
        moved = mean(after[sample]) - mean(values)
        # Even samples had advantage +1, odd ones -1.
        assert (moved > 0) == (int(sample) % 2 == 0), (sample, moved)


@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [
        (1, ["train.micro_batch_size=8"]),  # one padded micro-batch instead of packed ones
        (2, ["parallel.ep=2", "train.max_tokens_per_gpu=40"]),
        (2, ["parallel.tp=2"]),
        (2, ["parallel.pp=2", "train.max_tokens_per_gpu=40"]),
        (2, ["train.max_tokens_per_gpu=40"]),  # DP2
        (1, ["train.max_tokens_per_gpu=40", "train.inject_oom_above_tokens=30"]),  # OOM: split and redo
    ],
    ids=str,
)
def test_update_is_independent_of_layout_and_micro_batching(
    tmp_path, tiny_model, reference, nproc, overrides
):
    results, weights = run(tmp_path, tiny_model, "steps", nproc, *overrides)
    ref_results, ref_weights = reference
    ours, theirs = last_stage(results)["metrics"], last_stage(ref_results)["metrics"]
    injected = any("inject_oom" in o for o in overrides)
    assert (ours[-1]["train/oom_retries"] > 0) == injected
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], abs=1e-5)
        assert mine["train/pg_loss"] == pytest.approx(ref["train/pg_loss"], abs=1e-6)
    if not any("tp=" in o or "pp=" in o or "ep=" in o for o in overrides):  # same local shapes
        for name, tensor in ref_weights.items():
            # Adam turns rounding-level gradient differences on near-zero gradients into +-lr steps,
            # so compare the mean difference, bounded by that on every element.
            difference = (weights[name] - tensor).abs()
            assert difference.mean() < 1e-6 and difference.max() <= 2e-3 + 1e-6, name


def test_virtual_pipeline_update_equals_one_rank(tmp_path, tiny_model):
    """pp2 x vpp2 on a 4-layer model (one layer per virtual stage), dynamic batching: micro-batches
    padded to a multiple of pp and to equal shapes for the interleaved schedule. Two updates, then
    the logprobs of the updated policy."""
    budget = "train.max_tokens_per_gpu=40"
    one, _ = run(tmp_path, tiny_model, "steps", 1, budget, layers=4)
    vpp, _ = run(tmp_path, tiny_model, "steps", 2, "parallel.pp=2", "parallel.vpp=2", budget, layers=4)
    ours, theirs = last_stage(vpp)["metrics"], last_stage(one)["metrics"]
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], abs=1e-5)
        assert mine["train/pg_loss"] == pytest.approx(ref["train/pg_loss"], abs=1e-6)
    after, expected = last_stage(vpp)["after_logprobs"], last_stage(one)["after_logprobs"]
    assert after.keys() == expected.keys()
    for sample, values in expected.items():
        assert after[sample] == pytest.approx(values, abs=1e-5), sample


def test_offload_cycle_is_byte_identical(tmp_path, tiny_model, reference):
    results, _ = run(tmp_path, tiny_model, "offload", 1, "train.max_tokens_per_gpu=40")
    rank = results[0]
    assert rank["digests_equal"] is True
    assert rank["freed_bytes"] > 0 and rank["sizes_while_offloaded"] == 0
    continued = [m["train/grad_norm"] for m in rank["metrics"]]
    expected = [m["train/grad_norm"] for m in last_stage(reference[0])["metrics"]]
    assert continued == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.advantage_estimator=gspo", "algorithm.loss_reduction=seq_mean_token_mean"],
        [
            "algorithm.tis=true",
            "algorithm.mis=true",
            "algorithm.kl_loss_coef=0.1",
            "algorithm.entropy_coef=0.01",
        ],
        ["algorithm.advantage_estimator=reinforce_plus_plus", "algorithm.kl_coef=0.05"],
        ["algorithm.advantage_estimator=reinforce_plus_plus_baseline"],
        [  # Dr.GRPO's constant normaliser, sequence-level TIS, Geo-RS, KL loss under the same reduction
            "algorithm.loss_reduction=seq_mean_token_sum_norm",
            "algorithm.tis=true",
            "algorithm.tis_level=sequence",
            "algorithm.mis=true",
            "algorithm.mis_level=geometric",
            "algorithm.kl_loss_coef=0.1",
        ],
    ],
    ids=lambda o: o[0].split("=")[-1],
)
def test_algorithm_variants_train(tmp_path, tiny_model, overrides):
    results, _ = run(tmp_path, tiny_model, "steps", 1, "train.max_tokens_per_gpu=40", *overrides)
    first, second = last_stage(results)["metrics"]
    assert first["train/train_rollout_logprob_abs_diff"] == 0.0
    assert second["train/grad_norm"] > 0 and first["train/entropy"] > 0
    if "algorithm.tis=true" in overrides:
        assert first["train/tis_weight"] == pytest.approx(1.0)  # exact logprobs: every weight is 1
        assert first["train/mis_dropped"] == 0.0
        assert first["train/kl_loss"] == 0.0 and second["train/kl_loss"] > 0.0


def test_reference_from_ref_load_and_checkpoint_hf_export(tmp_path, tiny_model):
    """`model.ref_load`: the KL reference is that checkpoint's model, not the initial policy (whose
    KL at the first step is exactly 0); `checkpoint.save_hf`: every checkpoint holds an `hf/` model
    that transformers loads as is and that gives the trainer's logprobs, written by two EP ranks."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import PYTHON
    from tests.dist.rl_worker import make_batch

    other = tmp_path / "other_mcore"  # a different model of the same shape, as a Megatron checkpoint
    convert = [PYTHON, "-m", "slimrl.cli", "convert", "hf-to-mcore", "--workers", "1"]
    proc = subprocess.run(
        [*convert, "--hf-dir", str(tiny_model("qwen3_moe", seed=1)), "--out", str(other)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    policy = tiny_model("qwen3_moe")
    args = [
        "steps", f"model.hf_checkpoint={policy}", "cluster.gpus_per_node=2", "parallel.ep=2",
        "train.optimizer.lr=1e-3", "train.max_tokens_per_gpu=40", "algorithm.kl_loss_coef=0.1",
        f"model.ref_load={other}", "checkpoint.save_hf=true",
    ]  # fmt: skip
    results = run_torchrun(WORKER, 2, args, tmp_path / "out")
    assert last_stage(results)["metrics"][0]["train/kl_loss"] > 1e-3

    hf = tmp_path / "out" / "ckpt" / "hf"
    for name in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (hf / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    vocab = json.loads((policy / "config.json").read_text())["vocab_size"]
    for rank in results:
        batch = make_batch(vocab, 2, rank["coords"]["dp"])
        for index, trainer_logprobs in rank["after_logprobs"].items():
            tokens = torch.tensor([batch.tokens[int(index)]])
            n = batch.response_lengths[int(index)]
            with torch.no_grad():
                logits = model(tokens).logits.float()
            logprobs = torch.log_softmax(logits[0, -n - 1 : -1], dim=-1)
            ours = logprobs.gather(1, tokens[0, -n:, None])[:, 0]
            assert ours.tolist() == pytest.approx(trainer_logprobs, abs=1e-4)


def test_worker_scenarios_are_json(tmp_path):
    # Guard for the worker's output format used above.
    (tmp_path / "x.json").write_text(json.dumps({"metrics": []}))
    assert json.loads((tmp_path / "x.json").read_text())["metrics"] == []


def test_non_finite_gradients_skip_the_step_then_stop_the_run(tmp_path, tiny_model):
    """NaN in one rank's gradient (fault point, steps 2, 4 and 5 of 5): every rank skips that step
    and leaves weights and optimizer untouched; a good step between resets the count; two in a row
    (`train.max_nonfinite_steps=2`) stop it in one line naming the parameter. A non-finite weight is
    refused before a sync, by name."""
    model = tiny_model("qwen3_moe")
    args = [
        "nonfinite",
        f"model.hf_checkpoint={model}",
        "cluster.gpus_per_node=2",
        "train.max_nonfinite_steps=2",
    ]
    results = run_torchrun(WORKER, 2, args, tmp_path / "nonfinite")
    for rank in results:
        steps = rank["steps"]
        assert [s.get("changed") for s in steps] == [True, False, True, False, None]
        assert [s["metrics"]["train/update_ok"] for s in steps[:4]] == [1.0, 0.0, 1.0, 0.0]
        assert [s["metrics"]["train/skipped_steps"] for s in steps[:4]] == [0.0, 1.0, 1.0, 2.0]
        error = steps[4]["error"]
        assert error.startswith(
            "2 optimizer steps in a row had non-finite gradients (train.max_nonfinite_steps=2)"
        )
        assert "on trainer rank 0" in error and "\n" not in error
        assert rank["push_error"].startswith("weight sync: parameter ")
        assert rank["push_error"].endswith("on trainer rank 0 is not finite; nothing was pushed")
