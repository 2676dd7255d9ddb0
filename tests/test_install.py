"""The GPU extra resolves beside slimrl: pip's own resolver, asked to add `.[gpu]` (SGLang,
Transformer Engine, ModelOpt) to this environment, keeps every pinned core package as installed."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO

pytestmark = pytest.mark.slow

PINNED = {"torch", "transformers", "tokenizers", "numpy", "megatron-core", "sglang", "safetensors", "ray"}


def test_gpu_extra_resolves_beside_the_pinned_core(tmp_path) -> None:
    report = tmp_path / "report.json"
    cmd = [PYTHON, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), "-e", ".[gpu]"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = {
        item["metadata"]["name"].lower().replace("_", "-")
        for item in json.loads(report.read_text())["install"]
    }
    assert not (planned & PINNED), f"the GPU extra would replace pinned packages: {sorted(planned & PINNED)}"
    assert "transformer-engine" in planned and "nvidia-modelopt" in planned
