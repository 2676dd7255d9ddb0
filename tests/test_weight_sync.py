"""Weight sync from the Megatron trainer to running engines, over each transport: afterwards the
engines score fixed samples like the trainer does (exactly, in true on-policy mode)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimrl.config import load_config
from slimrl.rollout.servers import ServerProcess, embedded_command
from tests.conftest import PYTHON, REPO, free_port
from tests.dist.sync_worker import PROMPTS, RESPONSES

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "sync_worker.py"


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    model = tiny_model("qwen3_moe")
    config = load_config(None, [f"model.hf_checkpoint={model}", "cluster.gpus_per_node=2"])
    logs = tmp_path_factory.mktemp("engines")
    servers = []
    for index in range(2):
        port = free_port()
        cmd = embedded_command(config, str(model), "127.0.0.1", port, index)
        server = ServerProcess(f"engine{index}", cmd, "127.0.0.1", port, log_path=logs / f"e{index}.log")
        server.start()
        servers.append(server)
    try:
        for server in servers:
            server.wait_healthy(120)
        yield model, [s.url for s in servers]
    finally:
        for server in servers:
            server.stop()


def original_logprobs(model_dir) -> list[list[float]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
            tokens = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(tokens).logits[0, :-1].double(), -1)
            out.append([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)])
    return out


@pytest.mark.parametrize(
    ("transport", "nproc", "layout"),
    [("tensor", 1, []), ("distributed", 2, ["parallel.ep=2"]), ("disk", 2, ["parallel.tp=2"])],
    ids=lambda v: str(v),
)
def test_sync_makes_engines_score_like_the_trainer(tmp_path, engines, transport, nproc, layout):
    model, urls = engines
    args = [
        transport,
        ",".join(urls),
        str(tmp_path / "sync"),
        f"model.hf_checkpoint={model}",
        f"cluster.gpus_per_node={nproc}",
        "train.optimizer.lr=0.05",
        "rollout.update_weight_buffer_bytes=20000",
        *layout,
    ]
    results = run_rank0(tmp_path, args, nproc)
    trainer, before = results["trainer"], original_logprobs(model)
    moved = max(abs(a - b) for t, o in zip(trainer, before, strict=True) for a, b in zip(t, o, strict=True))
    assert moved > 1e-3, "the training step did not change the weights"
    for url in urls:
        assert results["versions"][url] == "v1"
        for engine_row, trainer_row in zip(results["engines"][url], trainer, strict=True):
            assert engine_row == pytest.approx(trainer_row, abs=2e-5)
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
