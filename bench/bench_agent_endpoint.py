"""The agent endpoint's overhead per model call: `/v1/chat/completions` through slimrl's endpoint
(chat template, session bookkeeping, token-in/token-out recording, the OpenAI reply) against the
same token ids sent as `/generate` through the same fleet client, measured in one run.

One embedded engine behind the real sglang-router serves both modes; rounds alternate between
them. Each round sends `--calls` calls at each concurrency of `--concurrency` (1 and 32 by default),
greedy, `--max-tokens` tokens each: in the endpoint mode each call is one agent session (opened,
called once with the OpenAI SDK over a shared connection pool, closed); in the baseline each is
one `FleetClient.generate` with the prompt ids the endpoint builds for that conversation. Measured
per mode: wall seconds (median over the rounds).

    python bench/bench_agent_endpoint.py [--calls 64] [--concurrency 1 32] [--max-tokens 16] [--rounds 3]

A third mode sends the same calls as plain HTTP POSTs (no SDK): the endpoint's own cost, without
the OpenAI SDK's request building and reply parsing (the agent's cost, paid by any agent).

Prints a JSON table; `generate_vs_endpoint_c<N>` (SDK) and `generate_vs_http_c<N>` (plain HTTP) are
the baseline's wall time over the endpoint's (1.0: the endpoint costs nothing beyond the engine call).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gate import record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
GREEDY = {"temperature": 0.0}


async def _endpoint_calls(endpoint: Any, calls: int, concurrency: int, max_tokens: int) -> float:
    """Each call one session with its own OpenAI client over one shared connection pool: what the
    endpoint adds, plus the SDK's own request path, which any agent pays per call. (A client with
    a pool of its own costs ~23 ms more to create: httpx loads the CA bundle even for plain http.)"""
    import httpx
    from openai import AsyncOpenAI

    gate_ = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as pool:

        async def one() -> None:
            async with gate_:
                session = endpoint.open_session(dict(GREEDY))
                try:
                    client = AsyncOpenAI(
                        base_url=endpoint.base_url(session), api_key=endpoint.api_key, http_client=pool
                    )
                    await client.chat.completions.create(
                        model="policy", messages=MESSAGES, max_tokens=max_tokens
                    )
                finally:
                    endpoint.close_session(session)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        return time.perf_counter() - start


async def _http_calls(endpoint: Any, calls: int, concurrency: int, max_tokens: int) -> float:
    """The same calls as plain HTTP POSTs (one aiohttp session, no SDK): the endpoint's own cost,
    without the OpenAI SDK's request building and reply parsing, which is the agent's."""
    import aiohttp

    gate_ = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": max_tokens}
    async with aiohttp.ClientSession(headers=headers) as http:

        async def one() -> None:
            async with gate_:
                session = endpoint.open_session(dict(GREEDY))
                try:
                    url = f"{endpoint.base_url(session)}/chat/completions"
                    async with http.post(url, json=body) as reply:
                        reply.raise_for_status()
                        await reply.json()
                finally:
                    endpoint.close_session(session)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        return time.perf_counter() - start


async def _generate_calls(
    client: Any, ids: list[int], calls: int, concurrency: int, max_tokens: int
) -> float:
    gate_ = asyncio.Semaphore(concurrency)
    params = {**GREEDY, "max_new_tokens": max_tokens}

    async def one() -> None:
        async with gate_:
            await client.generate(input_ids=ids, sampling_params=params, return_logprob=True)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers import AutoTokenizer

    from slimrl.data.tiny_models import make_tiny
    from slimrl.preflight import load_config
    from slimrl.rollout.agent.endpoint import AgentEndpoint
    from slimrl.rollout.fleet import Fleet

    kinds = ("endpoint", "http", "generate")
    modes = [f"{m}_c{c}" for c in args.concurrency for m in kinds]
    results: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny("qwen3_moe", Path(tmp) / "qwen3_moe")
        config = load_config(None, [f"model.hf_checkpoint={model_dir}", "rollout.num_engines=1"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)  # what the endpoint sends for MESSAGES
        with Fleet(config, str(model_dir), Path(tmp) / "logs") as fleet:
            assert fleet.client is not None

            async def measure() -> None:
                endpoint = await AgentEndpoint(tokenizer, fleet.client, context_length=512).start()
                try:
                    for round_index in range(args.rounds + 1):  # round 0 warms both modes up
                        for concurrency in args.concurrency:
                            for mode in kinds:
                                shape = (args.calls, concurrency, args.max_tokens)
                                if mode == "endpoint":
                                    wall = await _endpoint_calls(endpoint, *shape)
                                elif mode == "http":
                                    wall = await _http_calls(endpoint, *shape)
                                else:
                                    wall = await _generate_calls(
                                        fleet.client, ids, args.calls, concurrency, args.max_tokens
                                    )
                                if round_index:
                                    results[f"{mode}_c{concurrency}"].append(wall)
                finally:
                    await endpoint.close()
                    await fleet.client.close()

            asyncio.run(measure())
    medians = {mode: statistics.median(values) for mode, values in results.items()}
    ratios = {
        f"generate_vs_{mode}_c{c}": medians[f"generate_c{c}"] / medians[f"{mode}_c{c}"]
        for c in args.concurrency
        for mode in ("endpoint", "http")
    }
    table = {
        "calls": args.calls,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "wall_s_median": {mode: round(value, 3) for mode, value in medians.items()},
        "ms_per_call_overhead": {
            f"{mode}_c{c}": round(1e3 * (medians[f"{mode}_c{c}"] - medians[f"generate_c{c}"]) / args.calls, 2)
            for c in args.concurrency
            for mode in ("endpoint", "http")
        },
        **{name: round(value, 3) for name, value in ratios.items()},
    }
    print(json.dumps(table, indent=2))
    record("agent_endpoint", ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
