"""Streaming export from a running sharded model: every HF tensor exactly once, bit-exact, in
buckets; optional FP8 block quantisation matches the float64 reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slimrl.megatron_bridge.fp8 import dequantize_block_fp8
from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "export_worker.py"


def export(tmp_path, hf, nproc, bucket_bytes, fp8, *overrides):
    args = [str(hf), str(bucket_bytes), "1" if fp8 else "0", f"cluster.gpus_per_node={nproc}", *overrides]
    run_torchrun(WORKER, nproc, args, tmp_path)
    merged: dict[str, torch.Tensor] = {}
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rank in range(nproc):
        path = tmp_path / f"rank{rank}.safetensors"
        if path.exists():
            part = load_file(str(path))
            assert not set(part) & set(merged), "a tensor was exported by two ranks"
            merged.update(part)
    return merged, reports


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.ep=2"], ["parallel.pp=2"]], ids=str)
def test_export_is_exact_once_and_bucketed(tmp_path, tiny_model, layout):
    hf = tiny_model("qwen3_moe")
    bucket = 64 * 1024
    merged, reports = export(tmp_path, hf, 2, bucket, False, *layout)
    original = load_file(str(hf / "model.safetensors"))
    assert set(merged) == set(original)
    assert all(torch.equal(merged[n], t) for n, t in original.items())
    largest_tensor = max(t.numel() * t.element_size() for t in original.values())
    for report in reports:
        for size, count in report["buckets"]:
            assert size <= bucket or count == 1
            assert size <= max(bucket, largest_tensor)
    if layout == ["parallel.ep=2"]:  # each EP rank exports its own experts
        experts = [{n.split(".")[5] for n in r["names"] if ".experts." in n} for r in reports]
        assert experts == [{"0", "1"}, {"2", "3"}]


def test_export_fp8_blocks_match_reference(tmp_path, tiny_model):
    hf = tiny_model("qwen3_moe")
    merged, _ = export(tmp_path, hf, 2, 1 << 20, True, "parallel.tp=2")
    original = load_file(str(hf / "model.safetensors"))
    q = merged["model.layers.0.self_attn.q_proj.weight"]
    scale = merged["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1, 1)
    reference = original["model.layers.0.self_attn.q_proj.weight"].double()
    assert scale.item() == pytest.approx(reference.abs().max().item() / 448.0, rel=1e-6)
    error = (dequantize_block_fp8(q, scale).double() - reference).abs()
    assert (error <= reference.abs() * 2**-4 + scale.double() * 2**-10).all()
    assert merged["model.embed_tokens.weight"].dtype == torch.float32  # not quantised
    assert merged["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
