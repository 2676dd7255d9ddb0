"""Embedded engine throughput: generated tokens/s through HTTP at 1, 4 and 16 concurrent requests,
against a plain transformers `model.generate` loop (one request at a time) on the same tiny model.

Both run in this process's run on a freshly made tiny checkpoint: the server is `slimrl serve` in a
subprocess, the baseline runs here while the server idles. Every request decodes exactly
`--max-new-tokens` greedy tokens (EOS ignored), so all rows count the same work.

    python bench/bench_engine.py [--arch qwen3_moe] [--requests 32] [--max-new-tokens 64]

Prints a JSON table; exits 1 if 16-concurrency is below `--min-ratio` times 1-concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import requests
import torch

REPO = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 4, 16)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prompts(n: int) -> list[list[int]]:
    """Prompts of 8..23 tokens made of printable-character ids of the char tokenizer."""
    return [[3 + (7 * i + 3 * j) % 90 for j in range(8 + i % 16)] for i in range(n)]


def _baseline(model_dir: Path, prompts: list[list[int]], max_new: int) -> float:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kwargs = {"max_new_tokens": max_new, "min_new_tokens": max_new, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up
        start, tokens = time.perf_counter(), 0
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), **kwargs)
            tokens += out.shape[1] - len(prompt)
    return tokens / (time.perf_counter() - start)


async def _http(url: str, prompts: list[list[int]], max_new: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(prompt: list[int]) -> int:
            async with (
                gate,
                session.post(url + "/generate", json={"input_ids": prompt, "sampling_params": params}) as r,
            ):
                r.raise_for_status()
                return (await r.json())["meta_info"]["completion_tokens"]

        await one(prompts[0])  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - start)


def _start_server(model_dir: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "slimrl.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if "ready" not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-ratio", type=float, default=3.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from slimrl.data.tiny_models import make_tiny

    prompts = _prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(args.arch, Path(tmp) / args.arch)
        port = _free_port()
        proc = _start_server(model_dir, port)
        try:
            url = f"http://127.0.0.1:{port}"
            requests.get(url + "/health", timeout=30).raise_for_status()
            http = {c: asyncio.run(_http(url, prompts, args.max_new_tokens, c)) for c in CONCURRENCY}
            baseline = _baseline(model_dir, prompts, args.max_new_tokens)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    ratio = http[16] / http[1]
    rows = [{"mode": "hf_generate_sequential", "concurrency": 1, "tokens_per_s": round(baseline, 1)}]
    rows += [
        {
            "mode": "embedded_http",
            "concurrency": c,
            "tokens_per_s": round(tps, 1),
            "vs_hf_generate": round(tps / baseline, 2),
            "vs_http_c1": round(tps / http[1], 2),
        }
        for c, tps in http.items()
    ]
    table = {
        "arch": args.arch,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "ratio_c16_vs_c1": round(ratio, 2),
        "ok": ratio >= args.min_ratio,
    }
    print(json.dumps(table, indent=2))
    return 0 if table["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
