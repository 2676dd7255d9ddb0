"""The RL loop against the real SGLang 0.5.23 server on CPU (the referee): GRPO colocated over
shared memory, disaggregated and asynchronous over a broadcast group, and (the learning run) over
disk; an engine
killed mid-run is restarted and re-synced. The learning run (colocated) and the disaggregated one
replay the engine's MoE routing under EP2 (`algorithm.routing_replay`). The order of the control
calls each engine received is read from its own access log; colocated SGLang runs its real memory
release and resume (the memory saver's CPU stand-in loses released weights, as a GPU does)."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
from itertools import groupby
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.engines import assert_sglang_log
from tests.test_rl_e2e import alive, command, rows, running, wait_for_step

pytestmark = pytest.mark.slow

ACCESS = re.compile(r'"(?:POST|GET) /(\w+) HTTP/1\.1" (\d+)')
SYNC_CALLS = {
    "release_memory_occupation", "resume_memory_occupation", "pause_generation", "continue_generation",
    "begin_weight_update", "end_weight_update", "flush_cache", "init_weights_update_group",
    "update_weights_from_tensor", "update_weights_from_distributed", "update_weights_from_disk",
    "destroy_weights_update_group",
}  # fmt: skip
# Real SGLang on float32 CPU computes the trainer's logprobs to within this after every sync.
SYNCED = 1e-5
# ... and every single token to within this with routing replay on the engine's experts (fp32 both
# sides: rounding only; measured max 9.5e-7 over 30 colocated EP2 steps, mean 7e-8 to 1.4e-7).
REPLAYED_MAX = 1e-5
REPLAY = re.compile(r"train/(routing_disagreement|train_rollout_(logprob_abs_diff|prob_ratio).*)")


def control_calls(log: Path) -> list[str]:
    """Weight-sync and memory calls in the order the engine answered them (repeats collapsed);
    every one of them answered 200; the log is real SGLang's."""
    assert_sglang_log(log)
    calls = [(m[1], m[2]) for m in ACCESS.finditer(log.read_text(errors="replace")) if m[1] in SYNC_CALLS]
    assert all(status == "200" for _, status in calls), calls
    return [name for name, _ in groupby(name for name, _ in calls)]


def replay_figures(metrics: list[dict]) -> list[dict]:
    """Per step, the routing-replay metrics (disagreement, train/rollout mismatch)."""
    return [{k: v for k, v in r.items() if REPLAY.match(k)} for r in metrics]


def run(tmp_path: Path, name: str, model: Path, data: Path, *overrides: str) -> list[dict]:
    cmd = command(tmp_path, name, model, data, "logging.tensorboard=false", *overrides)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return rows(tmp_path / name)


def test_grpo_colocated_tensor_against_real_sglang_survives_a_killed_engine(
    tmp_path, tiny_model, mod_sum_data
):
    """GRPO colocated on two real SGLang engines over `tensor` (shared memory), with the colocated
    GPU default (trainer offloads, engines release memory); engine 0 is SIGKILLed mid-run, restarted
    and re-synced. Engines release before the trainer builds; per step: release -> train -> offload
    -> resume weights -> push -> resume KV cache, as each engine's own access log shows."""
    steps = 5
    name = "sglang_tensor"
    cmd = command(
        tmp_path, name, tiny_model("qwen3_moe"), mod_sum_data, "rollout.engine=sglang",
        f"train.num_steps={steps}", "checkpoint.save_interval=3", "train.offload=true",
    )  # fmt: skip
    run_dir = tmp_path / name
    with running(cmd) as (proc, output):
        wait_for_step(run_dir, 2, proc, timeout=600)
        victim = int((run_dir / "logs" / "engine0.pid").read_text())
        os.kill(victim, signal.SIGKILL)  # mid-run: the next rollout is already under way
        assert proc.wait(timeout=600) == 0, "".join(output)[-5000:]
    log = "".join(output)
    metrics = rows(run_dir)
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    for key in (
        "rollout/raw_reward", "rollout/response_length", "rollout/truncated_ratio", "rollout/tokens_per_s",
        "train/pg_loss", "train/entropy", "train/grad_norm", "train/clipfrac", "train/ppo_kl",
        "train/train_rollout_logprob_abs_diff", "perf/rollout_seconds", "perf/train_seconds",
        "perf/weight_sync_seconds", "perf/step_seconds", "perf/overhead_ratio", "perf/verify_seconds",
        "verify/probe_tokens", "verify/unchanged_tensors",
    ):  # fmt: skip
        assert all(isinstance(r[key], float) for r in metrics), key
    # the probe compares its tokens before any router near tie (none: a tie at the first token)
    compared = [r for r in metrics if r["verify/probe_tokens"]]
    assert all(isinstance(r["verify/probe_logprob_abs_diff"], float) for r in compared)
    assert metrics[-1]["rollout/engine_restarts"] >= 1 and "is dead: restarting it" in log
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in metrics]
    print("real SGLang, tensor: train/rollout |dlogp| per step", diffs)
    assert max(diffs) < SYNCED  # every engine, the restarted one too, has the trainer's weights
    assert all(r["rollout/samples"] == 16 * 8 for r in metrics)  # in-flight samples were regenerated
    new_pid = int((run_dir / "logs" / "engine0.pid").read_text())
    assert new_pid != victim and not alive(new_pid)  # replaced, then stopped with the run
    # SGLang's real release/resume path (its memory saver's CPU stand-in loses the weights): the
    # first rollout runs on pushed weights, and every sync resumes only what was released
    step = ["release_memory_occupation", "pause_generation", "resume_memory_occupation",
            "begin_weight_update", "update_weights_from_tensor", "end_weight_update", "flush_cache",
            "resume_memory_occupation", "continue_generation"]  # fmt: skip
    assert control_calls(run_dir / "logs" / "engine1.log") == step * (steps + 1)
    # the restarted engine released its memory like the fleet before the push that resumed it
    restarted = control_calls(run_dir / "logs" / "engine0.log")
    assert restarted[-len(step) :] == step, restarted

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("rollout/raw_reward")
    assert [e.step for e in rewards] == list(range(1, steps + 1))
    assert rewards[-1].value == pytest.approx(metrics[-1]["rollout/raw_reward"], rel=1e-6)
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith(str(steps))


def test_grpo_async_disaggregated_distributed_against_real_sglang(tmp_path, tiny_model, mod_sum_data):
    """Two training ranks (EP2) beside one engine, routing replay on, with the counterfactual."""
    steps = 4
    metrics = run(
        tmp_path, "sglang_async", tiny_model("qwen3_moe"), mod_sum_data, "rollout.engine=sglang",
        f"train.num_steps={steps}", "cluster.colocate=false", "cluster.gpus_per_node=3",
        "cluster.rollout_gpus=1", "rollout.num_engines=1", "parallel.ep=2", "algorithm.async_staleness=1",
        "algorithm.routing_replay=true", "algorithm.routing_replay_counterfactual=true",
    )  # fmt: skip
    assert [r["rollout/weight_version_lag"] for r in metrics] == [0.0] + [1.0] * (steps - 1)
    assert metrics[0]["train/train_rollout_logprob_abs_diff"] < SYNCED
    print("real SGLang, disaggregated EP2 replay:", replay_figures(metrics))
    # Replay metrics every step. A step whose rollout ran on the trainer's weights has the trainer's
    # own routing: disagreement 0, and replaying it or not (the counterfactual) leaves the engine's
    # logprobs. Those are step 1 and any step all of whose earlier updates had no gradient (a batch
    # of all-equal groups): Adam's momentum moves the weights on a step without gradient once any
    # earlier step had one (CI saw it: grad 0.35, 0, 0.34 gave disagreement 0.055 at step 3; the
    # optimizer has no weight decay, so before any gradient nothing moves). After a real update the routers
    # disagree on some tokens (measured 18% and 8% of token x layer pairs at steps 3-4, mismatch
    # 0.051 and 0.041 with replay vs 0.052 and 0.041 without: the rest is the weights' change).
    for r in metrics:
        assert 0.0 <= r["train/routing_disagreement"] <= 1.0
        assert r["train/train_rollout_logprob_abs_diff_max_no_replay"] >= 0.0
    pairs = list(itertools.pairwise(metrics))
    first_gradient = next((i for i, r in enumerate(metrics) if r["train/grad_norm"] > 0), len(metrics))
    for r in metrics[: first_gradient + 1]:
        assert r["train/routing_disagreement"] == 0.0, r["step"]
        assert r["train/train_rollout_logprob_abs_diff_max"] < REPLAYED_MAX, r["step"]
        assert r["train/train_rollout_logprob_abs_diff_max_no_replay"] < REPLAYED_MAX, r["step"]
    # off-policy by one update afterwards: the mismatch is visible, as it must be, after every
    # update that changed the weights (a batch of all-equal groups has no gradient)
    moved = [now for before, now in pairs if before["train/grad_norm"] > 0]
    assert moved and all(r["train/train_rollout_logprob_abs_diff"] > 1e-6 for r in moved)

    # the broadcast group is opened at the first sync and kept (not rebuilt at every sync); the
    # first sync is at step 0: the update check reset the engine's weights to check that push
    def sync(*group: str) -> list[str]:
        return ["pause_generation", "begin_weight_update", *group, "update_weights_from_distributed",
                "end_weight_update", "flush_cache", "continue_generation"]  # fmt: skip

    calls = control_calls(tmp_path / "sglang_async" / "logs" / "engine0.log")
    assert calls == sync("init_weights_update_group") + sync() * steps


def test_grpo_learns_against_real_sglang_over_disk_keeping_one_version(tmp_path, tiny_model, mod_sum_data):
    """The reward rises with real SGLang generating, as with the embedded engine, and the engine's
    logprobs stay the trainer's after every one of the updates that made it rise. The updates go
    over disk (`rollout.weight_sync=disk`: SGLang reloads each version from its files), so this run
    also proves that transport against real SGLang: one version kept, and the engine's own log
    shows the colocated order for a disk update at every step."""
    steps, name = 30, "sglang_learns"
    metrics = run(
        tmp_path, name, tiny_model("qwen3_moe"), mod_sum_data, "rollout.engine=sglang",
        f"train.num_steps={steps}", "rollout.num_engines=1", "rollout.rollout_batch_size=64",
        "rollout.n_samples_per_prompt=8", "train.optimizer.lr=1e-3", "checkpoint.save_interval=null",
        "algorithm.routing_replay=true",  # EP2 (the demo config's), colocated
        "rollout.weight_sync=disk",
    )  # fmt: skip
    reward = [r["rollout/raw_reward"] for r in metrics]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    print("real SGLang GRPO: first-10", first, "last-10", last)
    # measured on 2 cores: first-10 0.014, last-10 0.040 (issue 22 quoted 0.09 from another
    # machine); required: 70% of the measured end point, besides the rise itself
    assert last > first + 0.02 and last > 2 * first and last >= 0.028, (first, last)
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in metrics) < SYNCED
    print("real SGLang, colocated EP2 replay:", replay_figures(metrics))
    # Replay: the trainer routed every token to the engine's experts, and measured every step how
    # often its own router would have chosen otherwise (fp32 on both sides: never).
    assert [r["train/routing_disagreement"] for r in metrics] == [0.0] * steps
    assert max(r["train/train_rollout_logprob_abs_diff_max"] for r in metrics) < REPLAYED_MAX
    assert all(r["train/train_rollout_prob_ratio_median"] == pytest.approx(1.0, abs=SYNCED) for r in metrics)

    versions = sorted(p.name for p in (tmp_path / name / "weight_sync").iterdir())
    assert versions == [f"v{steps}"]  # the start push (v0) and every later one pruned
    # Every update passed its check at the first push. Two clean clones saw one fail here (a retry,
    # then at step 22 a stop: "the probe's logprobs differ from the trainer's by 0.000303") while the
    # engine held the pushed weights: a router near tie in the probe rounded to another expert on
    # the engine. The probe now compares only tokens before the trainer's first near tie.
    assert metrics[-1]["verify/retries"] == 0 and metrics[-1]["rollout/engine_restarts"] == 0, metrics[-1]
    probe_tokens = [int(r["verify/probe_tokens"]) for r in metrics]
    print("update check: probe tokens compared per step", probe_tokens)
    assert all(0 <= n <= 15 for n in probe_tokens)
    # colocated: released memory, resumed for the update, then the KV cache; a push before step 1
    sync = ["release_memory_occupation", "pause_generation", "resume_memory_occupation",
            "update_weights_from_disk", "flush_cache", "resume_memory_occupation",
            "continue_generation"]  # fmt: skip
    assert control_calls(tmp_path / name / "logs" / "engine0.log") == sync * (steps + 1)


def test_a_corrupted_update_is_pushed_again_then_stops_the_run_naming_the_tensor(
    tmp_path, tiny_model, mod_sum_data
):
    """Bytes flipped on the way to real SGLang (the fault point `SLIMRL_FAULT_CORRUPT_UPDATE`), in
    one router's weights. The first update (checked exactly: SGLang's snapshot / reset / compare)
    is corrupted once: SGLang's own compare names the tensor and the second push heals it. The next
    update is corrupted at every push (at another place each time): its probe scores off the
    trainer's, the second push names the tensor, and the run stops in one line, resumable from the
    checkpoint of the step."""
    name = "corrupted"
    cmd = command(
        tmp_path, name, tiny_model("qwen3_moe"), mod_sum_data, "rollout.engine=sglang", "train.num_steps=2",
        "rollout.num_engines=1", "checkpoint.save_interval=1", "logging.tensorboard=false",
    )  # fmt: skip
    env = {**os.environ, "SLIMRL_FAULT_CORRUPT_UPDATE": "layers.1.mlp.gate@0x1,layers.0.mlp.gate@1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    healed = [line for line in proc.stderr.splitlines() if "weight update 0 failed its check" in line]
    assert len(healed) == 1, proc.stderr[-3000:]
    assert "model.layers.1.mlp.gate.weight differs from the snapshot" in healed[0]
    assert healed[0].endswith("pushed it once more: the start-up snapshot checks it again")
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("slimrl: error: weight update 1 failed its check twice"), error
    assert_sglang_log(tmp_path / name / "logs" / "engine0.log")
    assert "the probe's logprobs differ from the trainer's" in error
    assert "model.layers.0.mlp.gate.weight differs between the two pushes" in error
    checkpoint = tmp_path / name / "checkpoints" / "iter_0000001"
    assert f"resubmit to resume from {checkpoint}" in error
    assert (checkpoint / "driver_state.json").is_file()
