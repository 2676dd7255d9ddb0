"""True on-policy on CPU: `slimrl serve --true-on-policy` reports exactly the trainer's logprobs.

A real server generates responses (temperatures 1 and 0.7, different lengths, concurrent requests);
a real `MegatronActor` with `algorithm.true_on_policy=true` under torchrun (world 1; for the MoE
also DP2 and PP2) scores them. The two must agree bit for bit, before and after the engine
loads new weights. The engine's decode-time logprobs (what normal mode reports) are close but not
identical: reported per request as `decode_logprob_max_abs_diff`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import REPO, free_port, run_torchrun

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "true_on_policy_worker.py"
PROMPTS = ["2+3=", "hello world, ", "The quick brown fox", "x", "abc abc abc "]


class Serve:
    """`slimrl serve --true-on-policy` on a free port, stopped on exit."""

    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "slimrl.cli", "serve", "--model", str(model), "--port", str(self.port)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.stderr = log.open("w")
        self.proc = subprocess.Popen(
            [*cmd, "--true-on-policy"], stdout=subprocess.DEVNULL, stderr=self.stderr, env=env, cwd=REPO
        )

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"server exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:  # not listening yet, or busy loading the scorer
                pass
            time.sleep(0.2)

    def post(self, path: str, body: Any) -> Any:
        response = requests.post(self.url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.stderr.close()


@pytest.fixture
def serve(tmp_path) -> Iterator[Any]:
    servers: list[Serve] = []

    def start(model: Path) -> Serve:
        server = Serve(model, tmp_path / f"serve{len(servers)}.log")
        servers.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in servers:
        server.stop()


def generate_concurrently(server: Serve, seed: int) -> list[dict[str, Any]]:
    """Requests of mixed temperature and length, sent from parallel clients (continuous batching)."""
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        for temperature in (1.0, 0.7):
            params = {
                "temperature": temperature,
                "max_new_tokens": 6 + 5 * i,
                "sampling_seed": seed * 100 + i,
                "ignore_eos": i % 2 == 0,
            }
            jobs.append((prompt, temperature, params))

    def run(job: tuple[str, float, dict[str, Any]]) -> dict[str, Any]:
        prompt, temperature, params = job
        out = server.post("/generate", {"text": prompt, "sampling_params": params, "return_logprob": True})
        meta = out["meta_info"]
        triples = meta["output_token_logprobs"]
        return {
            "prompt_tokens": meta["prompt_tokens"],
            "response": [t[1] for t in triples],
            "logprobs": [t[0] for t in triples],
            "temperature": temperature,
            "decode_diff": meta["decode_logprob_max_abs_diff"],
        }

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return list(pool.map(run, jobs))


def with_prompt_ids(samples: list[dict[str, Any]], tokenizer_dir: Path) -> list[dict[str, Any]]:
    """Full token sequences (prompt as the server tokenised it + response) for the trainer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [p for p in PROMPTS for _ in (1.0, 0.7)]
    out = []
    for prompt, sample in zip(prompts, samples, strict=True):
        ids = tokenizer.encode(prompt)
        assert len(ids) == sample["prompt_tokens"]
        out.append(
            {
                "tokens": ids + sample["response"],
                "response_length": len(sample["response"]),
                "temperature": sample["temperature"],
            }
        )
    return out


@pytest.mark.parametrize(
    ("arch", "layouts"),
    [
        ("qwen3", [(1, [])]),
        # TP=1, EP=1 layouts of the MoE model: DP2 and PP2 (each DP rank scores every sample alone,
        # as a world of one would). Not EP>1: the all-to-all merges tokens of several ranks into
        # each expert's GEMM.
        ("qwen3_moe", [(2, []), (2, ["parallel.pp=2"])]),
    ],
    ids=["qwen3", "qwen3_moe"],
)
def test_engine_logprobs_equal_trainer_logprobs_exactly(tmp_path, tiny_model, serve, arch, layouts):
    first, second = tiny_model(arch), tiny_model(arch, seed=1)
    server = serve(first)
    before = generate_concurrently(server, seed=1)
    update = server.post("/update_weights_from_disk", {"model_path": str(second), "weight_version": "v2"})
    assert update["success"], update
    after = generate_concurrently(server, seed=2)
    phases = [
        {"checkpoint": str(first), "samples": with_prompt_ids(before, first)},
        {"checkpoint": str(second), "samples": with_prompt_ids(after, first)},
    ]
    samples_file = tmp_path / "phases.json"
    samples_file.write_text(json.dumps(phases))
    decode_diffs = [s["decode_diff"] for s in before + after]
    for nproc, layout in layouts:
        args = [str(samples_file), "algorithm.true_on_policy=true", f"cluster.gpus_per_node={nproc}", *layout]
        ranks = run_torchrun(WORKER, nproc, args, tmp_path / f"w{nproc}{''.join(layout)}")
        for rank in ranks:
            for engine_samples, trainer_logprobs in zip((before, after), rank["logprobs"], strict=True):
                for sample, trainer in zip(engine_samples, trainer_logprobs, strict=True):
                    if trainer is None:
                        continue  # not a last pipeline stage
                    assert len(sample["response"]) >= 1
                    # Bit-identical: the engine rescored with the trainer's own model and code.
                    diff = max(abs(a - b) for a, b in zip(sample["logprobs"], trainer, strict=True))
                    assert diff == 0.0, (layout, diff)
        assert any(v is not None for rank in ranks for v in rank["logprobs"][0])
    # Normal mode reports the decode-time logprobs: close to the trainer's, but not identical.
    print(f"{arch}: decode-time vs trainer logprobs, max |diff| = {max(decode_diffs):.3g}")
    assert max(decode_diffs) < 1e-4
    assert max(decode_diffs) > 0.0
