"""`slimrl train` with GRPO end to end on Ray: two Megatron ranks (EP2), two embedded engines behind
sglang-router, weight sync every step. Faults are real: an engine process is SIGKILLed mid-run, the
driver is SIGTERMed and started again; both engines are SIGKILLed mid-rollout."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
CONFIG = REPO / "configs" / "tiny_moe_grpo_cpu.yaml"


def command(tmp_path: Path, name: str, model: Path, data: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "slimrl.cli", "train", str(CONFIG), f"model.hf_checkpoint={model}",
        f"data.prompt_data={data}", f"run.runs_dir={tmp_path}", f"run.name={name}",
        # 16 x 8 samples: the demo's group size is 16 for learning speed; these tests check
        # the loop's machinery, at the cost they always had.
        "rollout.rollout_batch_size=16", "rollout.n_samples_per_prompt=8", *overrides,
    ]  # fmt: skip


@contextmanager
def running(cmd: list[str]) -> Iterator[tuple[subprocess.Popen, list[str]]]:
    """`cmd` started from the repo, its merged output collected as it comes (a full pipe would
    block it) and shown with any assertion that fails inside; killed on the way out."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        yield proc, output
    except AssertionError as err:  # a failure shows what the run printed
        proc.kill()
        reader.join(10)
        tail = "".join(output)[-8000:]
        raise AssertionError(f"{err}\n--- the run's output, last 8000 characters ---\n{tail}") from None
    finally:
        proc.kill()
        reader.join(10)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(rows(run_dir)) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not reach step {step} (exit code {proc.poll()})")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def test_a_rollout_that_lost_every_engine_runs_again_on_restarted_ones(tmp_path, tiny_model, mod_sum_data):
    """Both engines SIGKILLed while a rollout is in flight: the rollout stops, the driver restarts
    them, gives them the current weights and runs that rollout again; the run completes on-policy."""
    steps = 4
    cmd = command(
        tmp_path, "all_down", tiny_model("qwen3_moe"), mod_sum_data, f"train.num_steps={steps}",
        "rollout.rollout_batch_size=64", "checkpoint.save_interval=null", "logging.tensorboard=false",
        # holds the step-3 rollout (rollout 2) until the engines are dead
        "rollout.custom_generate_function_path=tests.hook_fixtures.gated_generate",
    )  # fmt: skip
    run_dir = tmp_path / "all_down"
    with running(cmd) as (proc, output):
        deadline = time.monotonic() + 300
        while not (run_dir / "waiting").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "".join(output)[-5000:]
            time.sleep(0.1)
        victims = [int((run_dir / "logs" / f"engine{i}.pid").read_text()) for i in range(2)]
        for victim in victims:
            os.kill(victim, signal.SIGKILL)
        while any(alive(victim) for victim in victims):
            time.sleep(0.05)
        (run_dir / "gate").touch()
        assert proc.wait(timeout=600) == 0, "".join(output)[-5000:]
    log = "".join(output)
    assert re.search(r"every engine is down: restarting them; rollout 2 runs again", log), log[-5000:]
    metrics = rows(run_dir)
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    assert metrics[-1]["rollout/engine_restarts"] == 2.0
    assert all(r["rollout/samples"] == 64 * 8 for r in metrics)
    # The restarted engines loaded the HF checkpoint, which the updates of steps 1-2 had moved away
    # from; they generated step 3 with the trainer's weights.
    assert any(r["train/grad_norm"] > 0 for r in metrics[:2]), metrics
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in metrics) < 1e-4, metrics
    assert all(int(p.read_text()) not in victims for p in (run_dir / "logs").glob("engine*.pid"))


def test_a_rank_stuck_in_a_sync_stops_the_run_with_every_process_s_stacks(tmp_path, tiny_model, mod_sum_data):
    """Trainer rank 1 stops for good inside the sync after step 1 (the fault point
    `SLIMRL_FAULT_HANG_SYNC`); rank 0 waits for it in a collective. Past the bound the run stops in
    one line naming what each rank waits in, and the stacks of the driver, both trainer ranks and
    both engines are saved under the run's hang/ directory: rank 0's inside our collectives. The
    run resumes from step 1's checkpoint with step 1's metrics row, which the stop had cut off."""
    name = "hang"
    cmd = command(
        tmp_path, name, tiny_model("qwen3_moe"), mod_sum_data, "train.num_steps=2",
        "rollout.weight_sync_timeout_s=20", "checkpoint.save_interval=1", "logging.tensorboard=false",
    )  # fmt: skip
    env = {**os.environ, "SLIMRL_FAULT_HANG_SYNC": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("slimrl: error: weight sync to version 1 did not finish in 20 s"), error
    assert "rank 0: waits in " in error and "rank 1: not in a collective" in error, error
    hang_dirs = list((tmp_path / name / "hang").iterdir())
    assert len(hang_dirs) == 1 and f"every process's stacks are in {hang_dirs[0]}" in error
    saved = {p.name for p in hang_dirs[0].iterdir()}
    assert saved == {
        "summary.txt",
        "driver.txt",
        "trainer_rank0.txt",
        "trainer_rank1.txt",
        "engine0.txt",
        "engine1.txt",
    }
    stacks = {p.stem: p.read_text() for p in hang_dirs[0].iterdir()}
    assert "weight_sync/collectives.py" in stacks["trainer_rank0"], stacks["trainer_rank0"][:3000]
    assert "hang_sync" in stacks["trainer_rank1"] and "utils/faults.py" in stacks["trainer_rank1"]
    assert "in capture" in stacks["driver"]  # the driver's own, by faulthandler
    assert all("Thread" in stacks[f"engine{i}"] for i in (0, 1))
    assert (tmp_path / name / "checkpoints" / "iter_0000001").is_dir()  # resumable from step 1
    assert rows(tmp_path / name) == []  # stopped after the save, before step 1's row
    # Resumed: step 1's row comes back from its checkpoint (as it stood there: no sync metrics), so
    # metrics.jsonl has every step although the first attempt never wrote it.
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resumed from" in again.stderr, again.stderr[-3000:]
    first, second = rows(tmp_path / name)
    assert (first["step"], second["step"]) == (1, 2)
    assert "train/pg_loss" in first and "rollout/raw_reward" in first
    assert "perf/weight_sync_seconds" not in first
    assert "perf/weight_sync_seconds" in second


def test_sigterm_mid_run_then_resume(tmp_path, tiny_model, mod_sum_data):
    steps = 5
    cmd = command(
        tmp_path, "resume", tiny_model("qwen3_moe"), mod_sum_data,
        f"train.num_steps={steps}", "checkpoint.save_interval=2", "logging.tensorboard=false",
    )  # fmt: skip
    run_dir = tmp_path / "resume"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(run_dir, 3, proc)
        engine_pids = [int(p.read_text()) for p in (run_dir / "logs").glob("engine*.pid")]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert not [pid for pid in engine_pids if alive(pid)], "engine servers outlived the run"
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert done and all(not name.startswith(".") for name in done), done  # nothing partial published
    interrupted = rows(run_dir)

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-5000:]
    assert "resumed from" in again.stderr
    final = rows(run_dir)
    assert [r["step"] for r in final] == list(range(1, steps + 1))
    resumed_at = int(again.stderr.split("resumed from", 1)[1].split("(step ", 1)[1].split(")")[0])
    # A SIGTERM between a checkpoint's save and its step's row: the row comes from the checkpoint
    assert resumed_at in (2, 4) and resumed_at <= len(interrupted) + 1
    kept = min(resumed_at, len(interrupted))
    assert final[:kept] == interrupted[:kept]  # the steps before the checkpoint are kept
    # rollout.save_samples: every rollout's samples once, those redone after the resume included
    ids = [json.loads(line)["rollout_id"] for line in (run_dir / "rollout_samples.jsonl").open()]
    assert [ids.count(i) for i in range(steps)] == [16 * 8] * steps and len(ids) == steps * 16 * 8
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in final) < 1e-4  # engines re-synced


def test_async_disaggregated_run(tmp_path, tiny_model, mod_sum_data):
    """One training rank, one engine on its own slot, rollout k+1 generated while step k trains.
    `RAY_ADDRESS` names a cluster that is not there: with `ray.address: null` the run starts its
    own Ray all the same (Ray's default would try to join it)."""
    steps = 4
    cmd = command(
        tmp_path, "async", tiny_model("qwen3_moe"), mod_sum_data,
        f"train.num_steps={steps}", "cluster.colocate=false", "cluster.rollout_gpus=1",
        "rollout.num_engines=1", "parallel.ep=1", "algorithm.async_staleness=1",
        "logging.tensorboard=false",
    )  # fmt: skip
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    metrics = rows(tmp_path / "async")
    assert [r["step"] for r in metrics] == list(range(1, steps + 1))
    # Rollout k+1 was sampled before update k: off-policy by one step, which the trainer sees.
    assert metrics[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert [r["rollout/weight_version_lag"] for r in metrics] == [0.0] + [1.0] * (steps - 1)
    moved = [now for before, now in itertools.pairwise(metrics) if before["train/grad_norm"] > 0]
    assert moved, "no update changed the weights"
    assert all(r["train/train_rollout_logprob_abs_diff"] > 1e-6 for r in moved)


LEARNED = {"dapo": 0.061, "gspo": 0.045, "rloo": 0.042}
"""Last-10 mean reward each estimator reached in the suite's own run (2 cores, first-10 0.012-0.017,
chance about 0.01); the test requires 70% of it."""

FAMILY = {
    "gspo": ["algorithm.advantage_estimator=gspo", "algorithm.loss_reduction=seq_mean_token_mean"],
    "rloo": ["algorithm.advantage_estimator=rloo"],
    "dapo": [  # clip-higher, token-level loss, dynamic sampling with a std threshold
        "algorithm.eps_clip_high=0.28",
        "rollout.dynamic_sampling_filter_path=slimrl.rollout.filters.nonzero_reward_std",
        "rollout.dynamic_sampling_std_threshold=0.01",
        "rollout.over_sampling_batch_size=64",
    ],
}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_algorithm_family_learns_the_toy_task(tmp_path, tiny_model, mod_sum_data, name):
    """Each estimator trains the tiny MoE from scratch through the whole loop: the mod-10 reward
    rises from chance (0.1 at best, ~0.01 for the random model's digit distribution)."""
    steps = 30
    cmd = command(
        tmp_path, name, tiny_model("qwen3_moe"), mod_sum_data, f"train.num_steps={steps}",
        "rollout.rollout_batch_size=64", "rollout.n_samples_per_prompt=8", "train.optimizer.lr=1e-3",
        "checkpoint.save_interval=null", "logging.tensorboard=false", *FAMILY[name],
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    # Before the filter: DAPO's dynamic sampling trains only on groups whose rewards differ, whose
    # mean is not the policy's.
    reward = [r.get("rollout/raw_reward_unfiltered", r["rollout/raw_reward"]) for r in rows(tmp_path / name)]
    assert len(reward) == steps
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last > first + 0.02 and last > 2 * first and last >= 0.7 * LEARNED[name], (first, last)
