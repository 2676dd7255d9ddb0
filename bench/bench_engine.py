"""Engine throughput: generated tokens/s through HTTP of the embedded engine (1, 4, 16, 32 concurrent
requests) and of real SGLang 0.5.23 (1 and 32), against a plain transformers `model.generate` loop
(one request at a time) on the same tiny model (the `make demo` model by default).

All run in one run on a freshly made tiny checkpoint: each server is started by slimrl's launch
code (`rollout.engine=embedded|sglang`, one at a time), the baseline runs here after them. Every
request decodes exactly `--max-new-tokens` greedy tokens (EOS ignored), so all rows count the same
work.

    python bench/bench_engine.py [--arch qwen3_moe] [--requests 32] [--max-new-tokens 64]

Prints a JSON table with `embedded_vs_sglang` (tokens/s ratio per concurrency; the embedded
engine exists only while it is not slower than SGLang on CPU); exits 1 if the embedded engine's
16-concurrency is below `--min-ratio` times its 1-concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch
from gate import record

from slimrl.rollout.servers import ServerProcess

CONCURRENCY = {"embedded": (1, 4, 16, 32), "sglang": (1, 32)}
"""Real SGLang (the referee) is compared with the embedded engine at 1 and 32 concurrent requests."""


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


def _start_server(kind: str, model_dir: Path, log_dir: Path) -> ServerProcess:
    """One engine started by slimrl's own launch code (`rollout.engine=<kind>`), as a run does."""
    from slimrl.preflight import load_config
    from slimrl.rollout.servers import start_server

    config = load_config(None, [f"model.hf_checkpoint={model_dir}", f"rollout.engine={kind}"])
    return start_server(config, str(model_dir), log_dir / f"{kind}.log")


def _measure(
    kind: str, model_dir: Path, log_dir: Path, prompts: list[list[int]], args: Any
) -> dict[int, float]:
    """tokens/s of one engine at each of its concurrencies; 1-concurrency on `--c1-requests`
    prompts (a serial loop over all of them would dominate the run for no extra information)."""
    server = _start_server(kind, model_dir, log_dir)
    try:
        return {
            c: asyncio.run(_http(server.url, prompts[: args.c1_requests] if c == 1 else prompts,
                                 args.max_new_tokens, c))
            for c in CONCURRENCY[kind]
        }  # fmt: skip
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--c1-requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-ratio", type=float, default=3.0)
    parser.add_argument("--engines", default="embedded,sglang")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from slimrl.data.tiny_models import make_tiny

    prompts = _prompts(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny(args.arch, Path(tmp) / args.arch)
        http = {kind: _measure(kind, model_dir, Path(tmp), prompts, args) for kind in args.engines.split(",")}
        baseline = _baseline(model_dir, prompts, args.max_new_tokens)
    table = _table(args, http, baseline)
    print(json.dumps(table, indent=2))
    gated = {"embedded_c16_vs_c1": table.get("ratio_c16_vs_c1")}
    gated |= {f"embedded_vs_sglang_{c}": v for c, v in table.get("embedded_vs_sglang", {}).items()}
    record("engine", {name: value for name, value in gated.items() if value})
    return 0 if table["ok"] else 1


def _table(args: Any, http: dict[str, dict[int, float]], baseline: float) -> dict[str, Any]:
    rows = [{"mode": "hf_generate_sequential", "concurrency": 1, "tokens_per_s": round(baseline, 1)}]
    rows += [
        {"mode": f"{kind}_http", "concurrency": c, "tokens_per_s": round(tps, 1),
         "vs_hf_generate": round(tps / baseline, 2), "vs_http_c1": round(tps / by_c[1], 2)}
        for kind, by_c in http.items()
        for c, tps in by_c.items()
    ]  # fmt: skip
    table: dict[str, Any] = {
        "arch": args.arch,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    if "embedded" in http:
        table["ratio_c16_vs_c1"] = round(http["embedded"][16] / http["embedded"][1], 2)
        table["ok"] = table["ratio_c16_vs_c1"] >= args.min_ratio
    if "embedded" in http and "sglang" in http:
        table["embedded_vs_sglang"] = {
            f"c{c}": round(http["embedded"][c] / http["sglang"][c], 2) for c in CONCURRENCY["sglang"]
        }
    table.setdefault("ok", True)
    return table


if __name__ == "__main__":
    sys.exit(main())
