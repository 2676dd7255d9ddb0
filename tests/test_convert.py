"""Conversion CLIs end to end: HF -> torch_dist (TP/EP/PP, self-launched) -> HF is bit-exact,
`--verify` proves the logits, and bad input is one line with nothing left behind."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.slow
LOAD_WORKER = REPO / "tests" / "dist" / "load_worker.py"


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimrl.cli", "convert", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )


def to_hf(mcore: Path, out: Path, hf: Path, *layout: str) -> subprocess.CompletedProcess:
    return convert(
        "mcore-to-hf", "--ckpt", str(mcore), "--out", str(out), "--hf-config-dir", str(hf), *layout
    )


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def round_trip(tmp_path: Path, hf: Path, *layout: str) -> tuple[str, Path]:
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    to = convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(mcore), *layout, "--verify")
    assert to.returncode == 0, to.stderr[-3000:]
    home = to_hf(mcore, back, hf)
    assert home.returncode == 0, home.stderr[-3000:]
    original, converted = hf_tensors(hf), hf_tensors(back)
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert converted[name].dtype == tensor.dtype and torch.equal(converted[name], tensor), name
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert (back / "tokenizer.json").is_file() and (back / "config.json").is_file()
    return to.stdout, mcore


CASES = [
    ("qwen3_moe", {}, ["--tp", "2"]),
    ("qwen3_moe", {}, ["--ep", "2"]),
    ("qwen3_moe", {}, ["--pp", "2"]),
    ("qwen3_moe", {"num_experts": 3}, ["--ep", "3"]),  # expert count not a power of two
    ("qwen3_moe", {}, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    ("qwen3", {}, ["--tp", "2"]),
    # tied embeddings across pipeline stages, QKV bias; 3 layers over 2 stages: split 2 + 1, as the
    # trainer's uneven `parallel.pp_layout` may hold them (the checkpoint does not depend on it)
    ("qwen2", {"num_hidden_layers": 3}, ["--pp", "2"]),
    ("llama", {}, ["--tp", "2"]),
    ("deepseek_v3", {}, ["--ep", "2"]),  # MLA, shared experts, sigmoid router + bias, first-k dense
    ("deepseek_v3", {"rope_interleave": False}, ["--tp", "2"]),
]


@pytest.mark.parametrize(("arch", "overrides", "layout"), CASES, ids=lambda v: str(v))
def test_round_trip_is_bit_exact_and_verified(tmp_path, tiny_model, arch, overrides, layout):
    stdout, mcore = round_trip(tmp_path, tiny_model(arch, **overrides), *layout)
    line = next(line for line in stdout.splitlines() if line.startswith("verify:"))
    max_diff = float(line.split("max |logit diff| ")[1].split(",")[0])
    assert max_diff < 1e-5
    assert (mcore / "metadata.json").is_file() and list(mcore.glob("*.distcp"))


def test_checkpoint_reshards_into_another_layout(tmp_path, tiny_model):
    hf = tiny_model("qwen3_moe")
    assert (
        convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(tmp_path / "m"), "--tp", "2").returncode == 0
    )
    back = tmp_path / "back"
    proc = to_hf(tmp_path / "m", back, hf, "--ep", "2", "--pp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    original, converted = hf_tensors(hf), hf_tensors(back)
    assert all(torch.equal(converted[n], t) for n, t in original.items())


def index_of(ckpt: Path) -> dict[str, object]:
    """What a torch_dist index says about each key: dtype, global size and chunk grid."""
    with (ckpt / ".metadata").open("rb") as handle:
        meta = pickle.load(handle)
    summary: dict[str, object] = {}
    for key, entry in meta.state_dict_metadata.items():
        if not hasattr(entry, "chunks"):
            summary[key] = "bytes"
            continue
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        summary[key] = (entry.properties.dtype, tuple(entry.size), chunks)
    return summary


def test_megatron_loads_what_we_write_in_other_layouts(tmp_path, tiny_model):
    """Our writer's index matches the one Megatron's own saver writes (the `--verify` path), and
    Megatron's loader reads our checkpoint into other layouts with the HF weights, bit for bit."""
    hf, ours, theirs = tiny_model("qwen3_moe"), tmp_path / "ours", tmp_path / "theirs"
    assert convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(ours), "--tp", "2").returncode == 0
    proc = convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(theirs), "--tp", "2", "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert index_of(ours) == index_of(theirs)
    for layout in ("parallel.ep=2", "parallel.pp=2"):
        args = [str(ours), f"model.hf_checkpoint={hf}", "cluster.gpus_per_node=2", "algorithm.loss=sft"]
        args.append(layout)
        for rank in run_torchrun(LOAD_WORKER, 2, args, tmp_path / layout):
            assert rank["from_ckpt"] == rank["from_hf"], layout


def test_workers_split_the_layers_and_stay_exact(tmp_path, tiny_model):
    """`--workers 2` runs two processes that each write (and read) their own layers."""
    hf, mcore, back = tiny_model("qwen3_moe"), tmp_path / "m", tmp_path / "back"
    proc = convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(mcore), "--workers", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    writers = {p.name.split("_")[2] for p in mcore.glob("__*_*.distcp")}
    assert writers == {"0", "1"}  # both processes wrote data files
    # Read back under EP2 as well: its two dense replicas split the non-expert tensors too.
    proc = to_hf(mcore, back, hf, "--ep", "2", "--workers", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    original, converted = hf_tensors(hf), hf_tensors(back)
    assert set(converted) == set(original)
    assert all(torch.equal(converted[n], t) for n, t in original.items())
    assert len(list(back.glob("*.safetensors"))) >= 2  # every rank wrote its own shard file

    proc = convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(tmp_path / "x"), "--workers", "3")
    _one_line_error(proc, "--workers 3: pp*workers = 3 pipeline stages for only 2 layers")


def _one_line_error(proc: subprocess.CompletedProcess, fragment: str, code: int = 2) -> None:
    """One line naming what is at fault; a refused input exits 2, a failed conversion 1."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, tiny_model):
    hf = tiny_model("qwen3_moe")
    out = tmp_path / "out"

    truncated = _copy(hf, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    _one_line_error(
        convert("hf-to-mcore", "--hf-dir", str(truncated), "--out", str(out)), "truncated safetensors"
    )

    missing = _copy(hf, tmp_path / "missing")
    (missing / "model.safetensors").rename(missing / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    _one_line_error(convert("hf-to-mcore", "--hf-dir", str(missing), "--out", str(out)), "is missing")

    unsupported = _copy(hf, tmp_path / "unsupported")
    cfg = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    _one_line_error(
        convert("hf-to-mcore", "--hf-dir", str(unsupported), "--out", str(out)),
        "unsupported model_type `gpt2`",
    )

    lying = _copy(hf, tmp_path / "lying")
    (lying / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    _one_line_error(convert("hf-to-mcore", "--hf-dir", str(lying), "--out", str(out)), "shape mismatch")

    # Llama with attention_bias has an o_proj bias Megatron cannot hold without biasing every linear.
    biased = tiny_model("llama", attention_bias=True)
    _one_line_error(
        convert("hf-to-mcore", "--hf-dir", str(biased), "--out", str(out)), "self_attn.o_proj.bias"
    )

    _one_line_error(
        convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(out), "--verify", "--tolerance", "1e-12"),
        "verify failed",
        code=1,
    )
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary leftovers

    out.mkdir()
    (out / "keep").write_text("mine")
    _one_line_error(convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(out)), "output exists")
    assert (out / "keep").read_text() == "mine"


def test_megatron_to_hf_refuses_a_different_hf_config(tmp_path, tiny_model):
    hf = tiny_model("qwen3_moe")
    assert convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(tmp_path / "m")).returncode == 0
    other = _copy(hf, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_theta": 1000000.0}
    (other / "config.json").write_text(json.dumps(cfg))
    proc = to_hf(tmp_path / "m", tmp_path / "hf", other)
    _one_line_error(proc, "`rope_theta`")
    assert not (tmp_path / "hf").exists()


def test_damaged_torch_dist_checkpoint_is_one_line(tmp_path, tiny_model):
    hf, mcore = tiny_model("qwen3_moe"), tmp_path / "m"
    assert convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(mcore)).returncode == 0
    data = next(mcore.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    _one_line_error(to_hf(mcore, tmp_path / "hf", hf), "truncated .distcp")
    (mcore / ".metadata").unlink()
    _one_line_error(to_hf(mcore, tmp_path / "hf", hf), "no .metadata")
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no temporary leftovers


def test_out_overlapping_an_input_is_refused_before_anything_starts(tmp_path, tiny_model):
    hf = _copy(tiny_model("qwen3"), tmp_path / "hf")
    before = sorted(p.name for p in hf.iterdir())
    for out in (hf, hf / "mcore"):
        proc = convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(out), "--force")
        _one_line_error(proc, f"--out {out}: overlaps --hf-dir")
        assert proc.returncode == 2
    _one_line_error(to_hf(tmp_path, tmp_path / "back", hf), f"--out {tmp_path / 'back'}: overlaps --ckpt")
    assert sorted(p.name for p in hf.iterdir()) == before


def test_a_killed_conversion_leaves_nothing_the_next_run_keeps(tmp_path, tiny_model):
    """kill -9 mid-write leaves the writer's hidden temporary behind (nothing can clean up after
    SIGKILL); the next conversion to the same --out removes it and writes a complete output."""
    import os
    import signal
    import time

    hf = tiny_model("qwen3_moe")
    out = tmp_path / "mcore"
    cmd = [sys.executable, "-m", "slimrl.cli", "convert", "hf-to-mcore", "--hf-dir", str(hf),
           "--out", str(out), "--ep", "2"]  # fmt: skip
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=quiet, stderr=quiet)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".mcore.*.tmp")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    left = list(tmp_path.glob(".mcore.*.tmp"))
    assert left and not out.exists(), "the conversion finished before it could be killed"
    done = convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(out), "--ep", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mcore.")]
    assert "decoder.final_layernorm.weight" in index_of(out)  # a complete torch_dist index


def test_an_interrupted_replacement_gets_the_previous_output_back(tmp_path):
    """Killed between moving the old output aside and renaming the new one in: the old comes back."""
    from slimrl.utils.fs import clear_dead_writers

    final = tmp_path / "ckpt"
    trash = tmp_path / ".ckpt.old"
    trash.mkdir()
    (trash / "weights").write_text("previous")
    clear_dead_writers(final)
    assert (final / "weights").read_text() == "previous" and not trash.exists()
