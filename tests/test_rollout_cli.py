"""`slimrl rollout CONFIG key=value ...` as a user runs it: a real subprocess that starts its own
fleet (two embedded engines behind sglang-router), writes samples and metrics, and leaves no
process behind, whether it finishes, fails on a bad hook, or is stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from slimrl.data.toy_tasks import make_data
from slimrl.sample import Sample
from tests.conftest import PYTHON, REPO

pytestmark = pytest.mark.slow
SAMPLE_FIELDS = {f.name for f in dataclasses.fields(Sample)}


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "heldout.jsonl"
    make_data("mod_sum", path, num_samples=3, seed=5)
    return path


def command(
    runs: Path, model: Path, data: Path, eval_path: Path, *extra: str, rollouts: int = 1
) -> list[str]:
    return [
        PYTHON,
        "-m",
        "slimrl.cli",
        "rollout",
        "configs/tiny_moe_cpu.yaml",
        f"run.runs_dir={runs}",
        "run.name=gen",
        f"model.hf_checkpoint={model}",
        f"data.prompt_data={data}",
        "algorithm.loss=policy",
        "rollout.num_engines=2",
        "rollout.router.enabled=true",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.sampling.max_new_tokens=8",
        f"eval.datasets.heldout={eval_path}",
        "eval.sampling.max_new_tokens=8",
        "logging.tensorboard=false",
        *extra,
        # Last: `slimrl rollout` does not accept options between the key=value overrides.
        f"--num-rollouts={rollouts}",
    ]


class Watched:
    """A subprocess plus every descendant process seen while it ran."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.seen: set[int] = set()

    def poll(self) -> int | None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"slimrl rollout still running after {timeout} s:\n{self.output()}")
            time.sleep(0.1)
        return code

    def wait_for_output(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.output():
            assert self.poll() is None, f"exited before `{needle}`:\n{self.output()}"
            assert time.monotonic() < deadline, f"no `{needle}` after {timeout} s:\n{self.output()}"
            time.sleep(0.1)

    def output(self) -> str:
        return self.log.read_text()

    def left_behind(self) -> set[int]:
        """Descendants still running shortly after the command returned (zombies count as gone)."""
        deadline = time.monotonic() + 2.0
        while True:
            live = set()
            for pid in self.seen:
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        live.add(pid)
                except psutil.NoSuchProcess:
                    pass
            if not live or time.monotonic() > deadline:
                return live
            time.sleep(0.1)


def test_rollout_command_writes_samples_and_metrics(tmp_path, tiny_model, mod_sum_data, eval_data) -> None:
    cmd = command(tmp_path, tiny_model("qwen3_moe"), mod_sum_data, eval_data, rollouts=2)
    run = Watched(cmd, tmp_path / "out.log")
    assert run.wait(timeout=240) == 0, run.output()
    assert len(run.seen) >= 3, "expected two engines and the router"  # processes of the fleet
    assert not run.left_behind()

    run_dir = tmp_path / "gen"
    records = [json.loads(line) for line in (run_dir / "rollout_samples.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval/heldout"]
    assert len(train) == 2 * 2 * 2 and len(evals) == 2 * 3  # 2 rollouts x (2 prompts x 2, 3 eval prompts)
    assert sorted({r["rollout_id"] for r in records}) == [0, 1]
    for record in records:
        assert set(record) >= SAMPLE_FIELDS
        sample = Sample.from_dict(record)
        n = sample.response_length
        assert 0 < n <= 8 and len(sample.tokens) > n
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == n
        assert record["status"] in ("completed", "truncated") and record["reward"] in (0.0, 1.0)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for row in metrics:
        assert row["rollout/samples"] == 4 and "rollout/raw_reward" in row and "rollout/tokens_per_s" in row
        assert row["eval/heldout/samples"] == 3
    assert (run_dir / "logs" / "engine0.log").exists() and (run_dir / "logs" / "router.log").exists()


def test_bad_hook_fails_before_any_engine_starts(tmp_path, tiny_model, mod_sum_data, eval_data) -> None:
    cmd = command(
        tmp_path, tiny_model("qwen3_moe"), mod_sum_data, eval_data, "rollout.custom_rm_path=nope.rm"
    )
    run = Watched(cmd, tmp_path / "out.log")
    assert run.wait(timeout=120) == 2
    lines = [line for line in run.output().splitlines() if line.startswith("slimrl: error:")]
    assert lines == [
        "slimrl: error: rollout.custom_rm_path=nope.rm: cannot import module `nope`: No module named 'nope'"
    ]
    assert not run.seen and not (tmp_path / "gen" / "logs").exists()


def test_sigterm_stops_the_run_and_every_process(tmp_path, tiny_model, mod_sum_data, eval_data) -> None:
    long_run = "rollout.sampling.max_new_tokens=200"
    cmd = command(tmp_path, tiny_model("qwen3_moe"), mod_sum_data, eval_data, long_run, rollouts=1000)
    run = Watched(cmd, tmp_path / "out.log")
    run.wait_for_output("fleet up", timeout=180)
    time.sleep(1.0)  # rollouts are running
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 130, run.output()
    assert "slimrl: interrupted" in run.output()
    assert len(run.seen) >= 3 and not run.left_behind()
