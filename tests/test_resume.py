"""Kill `slimrl train` mid-run (SIGTERM), start it again: it resumes from the last complete
checkpoint and ends with the same weights and the same metrics as an uninterrupted run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.conftest import REPO

pytestmark = pytest.mark.slow
STEPS = 6


def command(tmp_path: Path, name: str, tiny_model, data) -> list[str]:
    return [
        sys.executable, "-m", "slimrl.cli", "train", str(REPO / "configs" / "tiny_moe_cpu.yaml"),
        f"model.hf_checkpoint={tiny_model('qwen3_moe')}", f"data.prompt_data={data}",
        f"run.runs_dir={tmp_path}", f"run.name={name}", f"train.num_steps={STEPS}",
        "checkpoint.save_interval=2", "logging.tensorboard=false",
        "train.lr_schedule.warmup_steps=2",  # the demo's 10 would outlast this short run (refused at load)
    ]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    reader = dcp.FileSystemReader(str(checkpoint))
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata) and "optimizer" not in key
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def survivors(marker: str, grace_s: float = 15.0) -> list[str]:
    """Processes still alive that carry the run's marker in their environment (Ray's daemons and
    workers, engines, the router), after giving them `grace_s` to finish exiting."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for process in psutil.process_iter(["pid", "name"]):
            with contextlib.suppress(psutil.Error):
                if process.environ().get("SLIMRL_TEST_MARKER") == marker and process.status() != "zombie":
                    alive.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def test_sigterm_then_resume_matches_uninterrupted(tmp_path, tiny_model, mod_sum_data):
    straight = subprocess.run(
        command(tmp_path, "straight", tiny_model, mod_sum_data), capture_output=True, text=True
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    run_dir = tmp_path / "killed"
    marker = f"slimrl-resume-test-{os.getpid()}"
    env = {**os.environ, "SLIMRL_TEST_MARKER": marker}  # inherited by every process the run starts
    proc = subprocess.Popen(
        command(tmp_path, "killed", tiny_model, mod_sum_data), stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 300
    while len(metrics(run_dir)) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    # One line says what happened: no traceback from the driver, Ray or an engine.
    assert stderr.strip().splitlines()[-1] == "slimrl: interrupted" and "Traceback" not in stderr, stderr[
        -3000:
    ]
    assert survivors(marker) == [], "processes of the interrupted run outlived it"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest in {"iter_0000002", "iter_0000004"}
    done_at_kill = len(metrics(run_dir))
    assert done_at_kill < STEPS

    resumed = subprocess.run(
        command(tmp_path, "killed", tiny_model, mod_sum_data), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    rows, reference = metrics(run_dir), metrics(tmp_path / "straight")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for mine, theirs in zip(rows, reference, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6), mine["step"]
    final_a = model_tensors(tmp_path / "straight" / "checkpoints" / f"iter_{STEPS:07d}")
    final_b = model_tensors(run_dir / "checkpoints" / f"iter_{STEPS:07d}")
    assert final_a.keys() == final_b.keys() and final_a
    for key, tensor in final_a.items():
        assert torch.allclose(final_b[key], tensor, atol=1e-6), key
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("iter_"))
    assert kept == ["iter_0000004", "iter_0000006"]  # checkpoint.keep_last=2
