"""Weight sync from the Megatron trainer to running engines, over each transport: afterwards the
engines score fixed samples like the trainer does (exactly, in true on-policy mode)."""

from __future__ import annotations

import json
import subprocess

import pytest

from slimrl.config import load_config
from slimrl.rollout.servers import ServerProcess, embedded_command
from tests.conftest import PYTHON, REPO, free_port

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "sync_worker.py"


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    model = tiny_model("qwen3_moe")
    overrides = [f"model.hf_checkpoint={model}", "cluster.gpus_per_node=2", "algorithm.true_on_policy=true"]
    config = load_config(None, overrides)  # engines rescore with the trainer's exact computation
    logs = tmp_path_factory.mktemp("engines")
    servers = []
    for index in range(2):
        port = free_port()
        cmd = embedded_command(config, str(model), "127.0.0.1", port, index)
        server = ServerProcess(f"engine{index}", cmd, "127.0.0.1", port, log_path=logs / f"e{index}.log")
        server.start()
        servers.append(server)
    try:
        for index, server in enumerate(servers):
            try:
                server.wait_healthy(180)
            except Exception as exc:
                log = (logs / f"e{index}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{exc}\n{log}") from exc
        yield model, [s.url for s in servers]
    finally:
        for server in servers:
            server.stop()


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
    model, urls = engines
    args = [
        transport,
        ",".join(urls),
        str(tmp_path / "sync"),
        f"model.hf_checkpoint={model}",
        f"cluster.gpus_per_node={nproc}",
        "train.optimizer.lr=0.05",
        "rollout.update_weight_buffer_bytes=20000",
        "algorithm.true_on_policy=true",
        *layout,
    ]
    results = run_rank0(tmp_path, args, nproc)
    for url in urls:
        assert results["versions"][url] == "v1"
    diffs = [
        abs(a - b)
        for e, t in zip(results["engine"], results["trainer"], strict=True)
        for a, b in zip(e, t, strict=True)
    ]
    assert max(diffs) <= tolerance
    first = [row[0] for row in results["engine"]]  # same prompt and seed: the first token is the same
    first_before = [row[0] for row in results["engine_before"]]
    assert max(abs(a - b) for a, b in zip(first, first_before, strict=True)) > 1e-3, (
        "engines kept the old weights"
    )
    assert results["sync"]["seconds"] > 0


def run_rank0(tmp_path, args, nproc) -> dict:
    """The worker writes only rank 0's result (the other ranks just take part)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           str(WORKER), str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((out / "rank0.json").read_text())
