"""The step-time model (`slimrl plan --time`, docs/step_time.md) against published RL step times,
and its command line. Fast: no processes but `python -m slimrl.cli plan ...`.

Every expected number comes from the published sources named in
`slimrl/planning/step_time_anchors.py`; the model supplies only the predictions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from slimrl.planning import step_time as st
from slimrl.planning.gpus import GPUS, gpu_spec
from slimrl.planning.step_time_anchors import ANCHORS, OPEN, anchor_spec, predicted, rows
from tests.conftest import REPO

TOLERANCE = 0.25
CONFIG_256 = "configs/grpo_moe_256gpu.yaml"
WORKLOAD = ["--prompt-tokens", "200", "--response-tokens", "4000"]

ROWS = rows()


def _id(row) -> str:
    return f"{row[0].key}:{row[1]}"


@pytest.mark.parametrize("row", [r for r in ROWS if r[4] == "checked"], ids=_id)
def test_predicted_phase_within_25_percent_of_published(row) -> None:
    anchor, phase, published, prediction, _ = row
    ratio = prediction / published
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{anchor.key} {phase}: {prediction:.1f} s vs {published} s ({ratio:.2f})"
    )


def test_listed_open_misses_still_miss() -> None:
    """A phase on the OPEN list (empty since session 27) that the model now predicts must leave it."""
    open_rows = [r for r in ROWS if r[4] == "open"]
    assert len(open_rows) == len(OPEN)
    for anchor, phase, published, prediction, _ in open_rows:
        fits = f"{anchor.key} {phase} now fits: remove it from OPEN"
        assert abs(prediction / published - 1) > TOLERANCE, fits


def test_calibration_phases_reproduce_their_published_value() -> None:
    """The constants were fitted on these phases (rounded): they come back within 5%."""
    calibration = [r for r in ROWS if r[4] == "calibration"]
    # 8B, 70B, 30B-A3B; verl's unknown response length and its per-call host offload
    assert len({r[0].key for r in calibration}) <= 4
    assert len(calibration) <= 8
    for anchor, phase, published, prediction, _ in calibration:
        assert abs(prediction / published - 1) < 0.05, (anchor.key, phase, prediction, published)


def test_open_and_unchecked_entries_name_real_phases() -> None:
    keys = {(a.key, p) for a in ANCHORS for p in a.published}
    assert set(OPEN) <= keys
    for anchor in ANCHORS:
        assert set(anchor.unchecked) <= set(anchor.published), anchor.key
        assert set(anchor.calibration) <= set(anchor.published), anchor.key
        assert "step" in anchor.published, anchor.key


def test_every_gpu_of_the_issue_has_a_sourced_row() -> None:
    assert {"H100", "H200", "H20", "B200", "GB200"} <= set(GPUS)
    for spec in GPUS.values():
        assert spec.source and spec.matmul_flops > 0 and spec.hbm_bytes_per_s > 0
        assert spec.fp8_flops == pytest.approx(2 * spec.matmul_flops)
    assert gpu_spec("gb200").name == "GB200"
    with pytest.raises(Exception, match="known: H100, H200, H20, B200, GB200"):
        gpu_spec("A100")


# ------------------------------------------------------------------------------- the model itself
def test_response_lengths_keep_the_given_mean_and_run_to_the_cap() -> None:
    w = st.Workload(samples=2048, prompt_tokens=100, response_tokens=3200, max_response_tokens=3996)
    mu, cap = w.scale(), w.max_response_tokens
    assert math.isclose(mu * -math.expm1(-cap / mu), 3200, rel_tol=1e-6)
    lengths = w.lengths(128)
    assert lengths == sorted(lengths) and lengths[-1] == cap
    assert abs(sum(lengths) / len(lengths) - 3200) < 0.03 * 3200
    assert w.expected_longest(1) == 3200 < w.expected_longest(4) < w.expected_longest(64) <= cap
    assert replace(w, longest_response=2000).longest() == 2000


def test_more_gpus_per_phase_do_not_slow_the_model_down() -> None:
    anchor = next(a for a in ANCHORS if a.key == "nemo-v0.6 qwen3-235b 128xH100")
    small, large = anchor_spec(anchor), anchor_spec(replace(anchor, gpus=256))
    a, b = st.predict(small), st.predict(large)
    assert b.phases["training"] < a.phases["training"]
    assert b.phases["generation"] < a.phases["generation"]


def test_phases_add_up_and_async_overlap_hides_the_shorter_side() -> None:
    anchor = next(a for a in ANCHORS if a.key == "nemo-v0.6 qwen3-30b-a3b 32xH100")
    spec = anchor_spec(anchor)
    sync = st.predict(spec)
    assert math.isclose(sum(sync.phases.values()), sync.step)
    assert sync.phases["overlap_hidden"] == 0.0
    overlapped = st.predict(replace(spec, colocate=False, async_staleness=1, offload=False))
    hidden = -overlapped.phases["overlap_hidden"]
    trainer_side = overlapped.step + hidden - overlapped.phases["generation"]
    assert hidden == pytest.approx(min(overlapped.phases["generation"], trainer_side))
    assert overlapped.step < sync.step


def test_predicted_phases_follow_the_anchor_mapping() -> None:
    anchor = next(a for a in ANCHORS if a.key == "nemo-v0.3 qwen3-32b 64xH100")
    spec = anchor_spec(anchor)
    phases = st.predict(spec).phases
    assert predicted(anchor, spec, "refit") == pytest.approx(phases["weight_sync"] + phases["offload"])
    assert predicted(anchor, spec, "logprobs") == pytest.approx(
        phases["policy_logprobs"] + phases["reference_logprobs"]
    )


def test_nemo_v03_refit_gathers_the_whole_model_across_pipeline_stages() -> None:
    """NeMo-RL v0.3's `gather_params` broadcasts every tensor from its PP stage to the whole PP
    group, and Megatron puts PP outermost (rank order tp-cp-ep-dp-pp): for the 70B row (TP4 PP4 on
    eight nodes) each GPU receives 3/4 of the bf16 model over its NIC. By hand from the data sheet:
    70.6 B params x 2 bytes x 3/4 at 400 Gb/s x 0.8."""
    anchor = next(a for a in ANCHORS if a.key == "nemo-v0.3 llama3.1-70b 64xH100")
    spec = anchor_spec(anchor)
    assert spec.transport == "gather"
    no_pp = replace(spec, trainer=replace(spec.trainer, layout=replace(spec.trainer.layout, pp=1)))
    pp_broadcast = st.weight_sync(spec)[0] - st.weight_sync(no_pp)[0]
    bf16_bytes = spec.engines.served_bytes
    assert bf16_bytes == pytest.approx(70.55e9 * 2, rel=0.01)
    assert pp_broadcast == pytest.approx(bf16_bytes * 3 / 4 / (400e9 / 8 * 0.8), rel=1e-6)
    eight_b = anchor_spec(next(a for a in ANCHORS if a.key == "nemo-v0.3 llama3.1-8b 8xH100"))
    assert st.weight_sync(eight_b)[0] == pytest.approx(
        eight_b.engines.served_bytes / st.WEIGHT_LOAD_BYTES_PER_S
        + eight_b.model.hf_tensors * st.WEIGHT_LOAD_S_PER_TENSOR
    )  # one GPU per engine, no TP, PP or EP: nothing to gather


def test_the_rerun_s_refit_is_slower_where_nothing_else_is() -> None:
    """Why the rerun's refit phases are unchecked (`RERUN_REFIT`): against the blog, both refits
    are at least 1.3x while every generation and logprob phase is at most 1.11x."""
    by_key = {a.key: a.published for a in ANCHORS}
    for size in ("llama3.1-8b 8xH100", "llama3.1-70b 64xH100"):
        blog, rerun = by_key[f"nemo-v0.3 {size}"], by_key[f"nemo-v0.3 rerun {size}"]
        assert rerun["refit"] / blog["refit"] >= 1.3
        for phase in ("generation", "logprobs"):
            assert abs(rerun[phase] / blog[phase] - 1) <= 0.112, (size, phase)
        assert "refit" in next(a for a in ANCHORS if a.key == f"nemo-v0.3 rerun {size}").unchecked


def test_verl_offloads_inside_each_timer_and_reduces_gradients_after_the_backward() -> None:
    """verl (`param_offload=True`) loads and offloads the actor inside `old_log_prob` and
    `update_actor`, each offload a fresh `.cpu().pin_memory()`; its DDP does not overlap the
    gradient reduction. Both are read from verl's code, so only `old_log_prob` is fitted."""
    anchor = next(a for a in ANCHORS if a.framework == "verl")
    spec = anchor_spec(anchor)
    phases = st.predict(spec).phases
    assert not spec.trainer.overlap_grad_reduce and spec.trainer.offload_reallocates
    offload = spec.trainer.params_bytes / st.REALLOCATING_OFFLOAD_BYTES_PER_S
    assert phases["offload"] == pytest.approx(offload)
    assert predicted(anchor, spec, "update_actor") == pytest.approx(
        phases["training"] + phases["onload"] + offload
    )
    overlapped = replace(spec, trainer=replace(spec.trainer, overlap_grad_reduce=True))
    assert st.training(overlapped) < st.training(spec)


def test_weight_transport_matches_the_config_gate() -> None:
    """`step_time_spec.transport_of` repeats `preflight/checks.py::weight_transport` one floor down."""
    from slimrl.planning.step_time_spec import transport_of
    from slimrl.preflight import load_config
    from slimrl.preflight.finalize import weight_transport

    for overrides in (
        [],
        ["cluster.colocate=false", "cluster.rollout_gpus=128", "rollout.num_engines=16"],
        ["rollout.weight_sync=disk"],
    ):
        config = load_config(REPO / CONFIG_256, overrides)
        assert transport_of(config) == weight_transport(config)


def test_the_256_gpu_config_times_in_under_5_seconds() -> None:
    from slimrl.planning.step_time_report import time_config
    from slimrl.preflight import load_config

    start = time.monotonic()
    result = time_config(load_config(REPO / CONFIG_256, []), gpu_spec("H100"), 200, 4000)
    assert time.monotonic() - start < 5
    assert result.phases["generation"] > result.phases["training"] > 0
    assert result.phases["policy_logprobs"] == 0  # one optimizer step, no KL: the training forward serves


def test_search_ranks_layouts_that_fit_by_step_time() -> None:
    from slimrl.planning.step_time_report import search
    from slimrl.preflight import load_config

    config = load_config(REPO / "configs/qwen3_30b_a3b_8gpu.yaml", [])
    ranked, counts = search(config, gpu_spec("H100"), 110, 3000, top=5)
    assert ranked and counts["fit"] == len(ranked) <= 5
    steps = [r.result.step for r in ranked]
    assert steps == sorted(steps)
    assert all(r.memory_gib <= config.cluster.gpu_memory_gb * 1.0001 for r in ranked)


# ------------------------------------------------------------------------------------ the CLI
def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimrl.cli", "plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_time_json_shape() -> None:
    out = _plan(CONFIG_256, "--time", "--json", *WORKLOAD, "rollout.rollout_batch_size=64")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) == {"phases", "step", "assumptions"}
    assert {"generation", "training", "weight_sync", "offload", "onload"} <= set(data["phases"])
    assert all(isinstance(v, float) for v in data["phases"].values())
    assert math.isclose(sum(data["phases"].values()), data["step"])
    assert "64 prompts" not in data["assumptions"]["workload"]  # responses, not prompts
    assert data["assumptions"]["workload"].startswith("512 responses")  # the override took


def test_compare_prints_both_and_their_ratio() -> None:
    out = _plan(CONFIG_256, "--compare", CONFIG_256, *WORKLOAD, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["a"]["step"] == pytest.approx(data["b"]["step"])


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (
            (CONFIG_256, "--time", "--gpu", "A100", *WORKLOAD),
            "choose from 'H100', 'H200', 'H20', 'B200', 'GB200'",
        ),
        ((CONFIG_256, "--time", "--prompt-tokens", "200"), "--response-tokens"),
        ((CONFIG_256, "--time", "--response-tokens", "200"), "--prompt-tokens"),
        (
            (CONFIG_256, "--time", *WORKLOAD, "parallel.ep=2", "parallel.pp=1", "parallel.pp_layout=null"),
            "gradients",
        ),
        ((CONFIG_256, "--json"), "--json"),
        ((CONFIG_256, "--time", "--prompt-tokens", "0", "--response-tokens", "1"), "--prompt-tokens"),
    ],
    ids=[
        "unknown-gpu",
        "no-response-tokens",
        "no-prompt-tokens",
        "does-not-fit",
        "json-alone",
        "zero-tokens",
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], names: str) -> None:
    out = _plan(*args)
    assert out.returncode == 2, out.stdout
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and names in err, err
    assert out.stdout == ""


def test_the_docs_count_the_published_phases_the_bench_checks() -> None:
    """README and docs/step_time.md state how many published phases there are and how they fare."""
    counts: dict[str, int] = {}
    for row in ROWS:
        counts[row[4]] = counts.get(row[4], 0) + 1
    readme = (REPO / "README.md").read_text()
    assert f"its ratios against {len(ROWS)} published phases" in readme
    summary = (
        f"{len(ROWS)} published phases: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + f"; all {counts['checked']} checked within 25%."
    )
    assert summary in (REPO / "docs" / "step_time.md").read_text()


def test_the_readme_s_prediction_is_what_the_cli_prints() -> None:
    """The README shows `slimrl plan configs/grpo_moe_256gpu.yaml --time ...`: its block is the
    command's output as the code prints it today (a change to the model changes the README)."""
    readme = (REPO / "README.md").read_text()
    args = ["configs/grpo_moe_256gpu.yaml", "--time", "--prompt-tokens", "200", "--response-tokens", "4000"]
    shown = readme.split(f"$ slimrl plan {' '.join(args)}\n", 1)[1].split("```", 1)[0]
    proc = _plan(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == shown
