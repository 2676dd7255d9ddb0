"""Weight sync from the Megatron trainer to running engines, over each transport: afterwards the
engines score fixed samples like the trainer does (exactly, in true on-policy mode)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, free_port
from tests.engines import running_engines

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "sync_worker.py"


@pytest.fixture(scope="module", params=["embedded"])
def engines(request, tiny_model, tmp_path_factory):
    """Two embedded engines, which rescore with the trainer's exact computation (true on-policy) so
    their figures are bitwise. Real SGLang takes every transport from every layout in
    `tests/test_transport_matrix.py` (two engines, colocated and disaggregated, one and two hosts)."""
    model = tiny_model("qwen3_moe")
    kind = request.param
    overrides = ["algorithm.true_on_policy=true"] if kind == "embedded" else []
    with running_engines(kind, model, tmp_path_factory.mktemp(f"engines_{kind}"), 2, *overrides) as urls:
        yield kind, model, urls


@pytest.mark.parametrize(
    ("transport", "nproc", "layout", "tolerance"),
    [
        ("tensor", 1, [], 0.0),  # TP=1: bitwise equal
        ("distributed", 2, ["parallel.ep=2"], 2e-6),  # experts batch tokens from two ranks
        ("disk", 2, ["parallel.tp=2"], 2e-6),  # split reductions
    ],
    ids=lambda v: str(v),
)
def test_sync_makes_engines_score_like_the_trainer(tmp_path, engines, transport, nproc, layout, tolerance):
    kind, model, urls = engines
    args = [
        transport,
        ",".join(urls),
        str(tmp_path / "sync" / "v1"),
        f"model.hf_checkpoint={model}",
        f"cluster.gpus_per_node={nproc}",
        "train.optimizer.lr=0.05",
        "rollout.update_weight_buffer_bytes=20000",
        "algorithm.true_on_policy=true",
        *layout,
    ]
    before = shm_segments()
    results = run_rank0(tmp_path, args, nproc)
    # Every bucket's shared segment is unlinked once its last reader is done; an engine may hold
    # on to the last one it loaded (the trainer, and with it its shm manager, is gone by now).
    left = run_segments(shm_segments() - before, results["pids"])
    assert len(left) <= len(urls), f"{len(left)} shared-memory segments left: {sorted(left)[:5]}"
    for url in urls:
        assert results["versions"][url] == "v1"
    diffs = [
        abs(a - b)
        for e, t in zip(results["engine"], results["trainer"], strict=True)
        for a, b in zip(e, t, strict=True)
    ]
    print(f"{kind} {transport}: max |engine - trainer| logprob after sync = {max(diffs):.3g}")
    assert max(diffs) <= tolerance
    first = [row[0] for row in results["engine"]]  # same prompt and seed: the first token is the same
    first_before = [row[0] for row in results["engine_before"]]
    assert max(abs(a - b) for a, b in zip(first, first_before, strict=True)) > 1e-3, (
        "engines kept the old weights"
    )
    assert results["sync"]["seconds"] > 0
    if transport == "disk":  # only the version the engines read is kept
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v1"]


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("torch_*")} if Path("/dev/shm").is_dir() else set()


def run_segments(names: set[str], pids: list[int]) -> set[str]:
    """Those of `names` a process of this run created (torch names them `torch_<pid>_...`): tests
    running beside this one make their own."""
    return {n for n in names if n.split("_")[1] in {str(p) for p in pids}}


def run_rank0(tmp_path, args, nproc) -> dict:
    """The worker writes only rank 0's result (the other ranks just take part)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           str(WORKER), str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((out / "rank0.json").read_text())
