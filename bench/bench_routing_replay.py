"""MoE routing replay (R3): a bf16 engine against the fp32 trainer, with and without replay.

One process. The "engine" is the Hugging Face model in bfloat16 (what a bf16 SGLang server
computes, up to kernels): it scores each sequence with one prefill and reports its response-token
logprobs and, per input token and MoE layer, the experts its router chose (recorded where the HF
router takes its top-k). The trainer is a one-rank fp32 `MegatronActor` with
`algorithm.routing_replay=true` on the same weights. Printed, in one JSON report:

* `disagreement`: fraction of (input token, MoE layer) pairs whose engine top-k set differs from
  the trainer's own (`train/routing_disagreement`), i.e. how many experts flip without replay; with
  replay the trainer uses the engine's experts, by construction;
* `mismatch`: |logp_trainer - logp_engine| over response tokens (mean, max) and the median
  probability ratio exp(|diff|), without and with replay;
* `step_seconds` / `overhead`: one RL training step (`train_rl`, old logprobs fused in the
  training forward, disagreement counted in it) with and without replay, median CPU seconds of
  `--repeats` alternating runs (goal: overhead < 3%); on a shared machine that is still noisy,
  so `replay_code_share` also times the replay's own work inside the replayed steps (setting the
  targets per micro-batch and chunk, counting the disagreement) as a share of their step time;
* `routing_bytes_per_token`: bytes of `Sample.rollout_routed_experts` per token (uint8 ids), and
  what that is for 32k tokens of a 94-layer top-8 model.

    python bench/bench_routing_replay.py [--samples 16] [--layers 4] [--experts 16] [--topk 4]

Exits 1 if the overhead is not below `--max-overhead` or replay does not lower the max mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gate import record

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch


def engine_score(model, tokens: list[int], response: int) -> tuple[list[float], np.ndarray]:
    """bf16 prefill: response logprobs and the router's choices `(len - 1, layers, top_k)`."""
    seen: list[torch.Tensor] = []
    real = torch.topk

    def topk(values: torch.Tensor, k: int, dim: int = -1, **kwargs):
        out = real(values, k, dim=dim, **kwargs)
        seen.append(out.indices)
        return out

    torch.topk = topk  # the HF Qwen3-MoE router's one top-k call per layer
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
    finally:
        torch.topk = real
    labels = torch.tensor(tokens[1:]).unsqueeze(1)
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, labels)[:, 0]
    routing = torch.stack(seen, dim=1)[:-1].numpy().astype(np.uint8)
    return logprobs[-response:].tolist(), routing


def mismatch(trainer: dict[int, list[float]], engine: list[list[float]]) -> dict[str, float]:
    diffs = np.abs(np.concatenate([np.asarray(trainer[i]) - np.asarray(e) for i, e in enumerate(engine)]))
    return {
        "abs_diff_mean": float(diffs.mean()),
        "abs_diff_max": float(diffs.max()),
        "prob_ratio_median": float(np.median(np.exp(diffs))),
    }


def alternating_medians(first: Callable[[], object], second: Callable[[], object], repeats: int):
    first(), second()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.process_time()  # CPU seconds: other jobs on the machine do not count
            fn()
            out.append(time.process_time() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _time_replay_work() -> list[float]:
    """Accumulate the seconds spent in the replay's own code (targets, disagreement count)."""
    from slimrl.trainer.routing_replay import EngineRouting, RoutingReplay

    spent = [0.0]

    def timed(fn: Callable[..., object]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.process_time() - start

        return run

    RoutingReplay.set_targets = timed(RoutingReplay.set_targets)  # type: ignore[method-assign]
    EngineRouting.count_disagreement = timed(EngineRouting.count_disagreement)  # type: ignore[method-assign]
    return spent


def _load_config(overrides: list[str]):
    from slimrl.preflight import load_config

    return load_config(None, [*overrides, "algorithm.routing_replay=true"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-overhead", type=float, default=0.03)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from transformers import AutoModelForCausalLM

    from slimrl.data.tiny_models import make_tiny
    from slimrl.trainer.actor import MegatronActor
    from slimrl.trainer.batch import PerToken, TrainBatch
    from slimrl.trainer.distributed import RankInfo
    from slimrl.utils.net import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe"
        shape = {
            "num_hidden_layers": args.layers,
            "num_experts": args.experts,
            "num_experts_per_tok": args.topk,
            "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden,
            "moe_intermediate_size": args.hidden // 2,
        }
        make_tiny("qwen3_moe", path, seed=0, overrides=shape)
        engine = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        rng = random.Random(0)
        vocab = engine.config.vocab_size
        tokens, responses = [], []
        for _ in range(args.samples):
            prompt, response = rng.randrange(16, 64), rng.randrange(32, 160)
            tokens.append([rng.randrange(3, vocab) for _ in range(prompt + response)])
            responses.append(response)
        scored = [engine_score(engine, t, r) for t, r in zip(tokens, responses, strict=True)]
        engine_lp = [lp for lp, _ in scored]
        batch = TrainBatch(
            tokens=tokens,
            response_lengths=responses,
            loss_masks=[[1] * n for n in responses],
            per_token=PerToken(
                advantages=[[rng.choice([-1.0, 1.0])] * n for n in responses], rollout_logp=engine_lp
            ),
            global_num_tokens=sum(responses),
            global_num_seqs=args.samples,
            routed_experts=[routing for _, routing in scored],
        )
        overrides = [
            f"model.hf_checkpoint={path}",
            "cluster.gpus_per_node=1",
            "train.max_tokens_per_gpu=2048",
            "train.optimizer.lr=1e-7",
        ]
        actor = MegatronActor(
            _load_config(overrides),
            RankInfo(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()),
        )
        actor.setup(total_steps=1000)
        routing = actor.routing
        assert routing is not None
        routing.measure_next = True
        with_replay = actor.response_logprobs(batch)
        counts = routing.take_disagreement()
        routing.enabled = False
        without_replay = actor.response_logprobs(batch)

        def step(replay: bool) -> Callable[[], object]:
            def run() -> object:
                routing.enabled = replay
                try:
                    return actor.train_rl(batch)
                finally:
                    routing.enabled = True

            return run

        spent = _time_replay_work()
        replayed, free = alternating_medians(step(True), step(False), args.repeats)
        replay_share = spent[0] / (replayed * (args.repeats + 1))
        per_token = batch.routed_experts[0].nbytes / len(batch.routed_experts[0])
    report = {
        "model": f"tiny qwen3_moe: {args.layers} layers, {args.experts} experts top-{args.topk}, "
        f"hidden {args.hidden}",
        "engine": "HF transformers, bfloat16",
        "trainer": "Megatron-Core, fp32, one rank",
        "samples": args.samples,
        "tokens": sum(len(t) for t in tokens),
        "response_tokens": sum(responses),
        "disagreement": {
            "without_replay": counts.disagree / max(counts.counted, 1),
            "with_replay": 0.0,
            "token_layer_pairs": counts.counted,
        },
        "mismatch": {
            "without_replay": mismatch(without_replay, engine_lp),
            "with_replay": mismatch(with_replay, engine_lp),
        },
        "step_seconds": {"with_replay": round(replayed, 4), "without_replay": round(free, 4)},
        "overhead": round(replayed / free - 1, 4),
        "replay_code_share": round(replay_share, 4),
        "routing_bytes_per_token": per_token,
        "routing_bytes_32k_tokens_94_layers_top8": 32768 * 94 * 8,
        "threads": torch.get_num_threads(),
    }
    mismatch_down = (
        report["mismatch"]["with_replay"]["abs_diff_max"]
        < report["mismatch"]["without_replay"]["abs_diff_max"]
    )
    report["goal"] = f"overhead < {args.max_overhead} and max mismatch lower with replay"
    report["goal_met"] = replayed / free - 1 < args.max_overhead and mismatch_down
    print(json.dumps(report, indent=2))
    record("routing_replay", {"free_over_replayed_step": free / replayed})
    return 0 if report["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
