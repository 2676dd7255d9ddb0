"""`slimrl train` end to end: Ray places two Megatron ranks (EP2), SFT runs, the run dir is complete."""

from __future__ import annotations

import json

import pytest
import yaml

from slimrl.preflight import load_config
from tests.conftest import REPO, run_slimrl

pytestmark = pytest.mark.slow


def test_sft_run_writes_config_metrics_and_tensorboard(tmp_path, tiny_model, mod_sum_data):
    steps = 15
    proc = run_slimrl(
        "train",
        str(REPO / "configs" / "tiny_moe_cpu.yaml"),
        f"model.hf_checkpoint={tiny_model('qwen3_moe')}",
        f"data.prompt_data={mod_sum_data}",
        f"run.runs_dir={tmp_path}",
        "run.name=sft",
        f"train.num_steps={steps}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "sft"

    saved = load_config(run_dir / "config.yaml")
    assert saved.train.num_steps == steps and saved.parallel.ep == 2
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["prompt_data"] == str(mod_sum_data)
    resolved = load_config(run_dir / "resolved.yaml")  # what the run used, every derived value set
    assert (resolved.train.global_batch_size, resolved.parallel.dp, resolved.model.dtype) == (32, 2, "fp32")
    assert resolved.train.lr_schedule.decay_steps == steps and resolved.cluster.device == "cpu"
    assert f"step {steps}/{steps} | loss" in proc.stderr  # progress lines (logging.log_interval=1)

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert set(rows[0]) == {"step", "loss", "grad_norm", "lr", "tokens", "seconds"}
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(r["tokens"] > 32 * 4 for r in rows)  # 32 prompts of >= 4 tokens plus answers
    assert rows[0]["lr"] < rows[6]["lr"]  # warm-up

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = events.Scalars("loss")
    assert [e.step for e in logged] == list(range(1, steps + 1))
    assert logged[-1].value == pytest.approx(rows[-1]["loss"], rel=1e-6)
