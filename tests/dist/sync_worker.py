"""torchrun worker: train one RL step, push the weights to running engines, score fixed samples.

Usage: torchrun ... tests/dist/sync_worker.py OUT_DIR TRANSPORT ENGINE_URLS(comma) SYNC_DIR key=value ...
Rank 0 writes OUT_DIR/rank0.json with responses the engines sampled after the update, the
logprobs the engines reported for them, and the trainer's logprobs of the same tokens.
"""

import faulthandler
import json
import os
import sys
from pathlib import Path

import requests
import torch.distributed as dist

from slimrl.preflight import load_config
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import PerToken, TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
RESPONSES = [[20, 21, 22], [23], [24, 25]]


def engine_sample(
    url: str, prompt: list[int], seed: int, temperature: float
) -> tuple[list[int], list[float]]:
    """A response sampled by the engine, with the logprobs it reports for it."""
    body = {
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": temperature,
            "sampling_seed": seed,
            "ignore_eos": True,
        },
        "return_logprob": True,
    }
    triples = requests.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"][
        "output_token_logprobs"
    ]
    return [int(t[1]) for t in triples], [float(t[0]) for t in triples]


def sample_all(urls: list[str], temperature: float) -> list[tuple[list[int], list[float]]]:
    return [engine_sample(u, p, i, temperature) for u in urls for i, p in enumerate(PROMPTS)]


def main() -> None:
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows its stack instead of a timeout
    out_dir, transport, urls, sync_dir = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4]
    config = load_config(None, sys.argv[5:])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=2)
    dp, dp_rank = actor.layout.dp, actor.coordinates()["dp"]
    seqs = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)] * 2
    lengths = [len(r) for r in RESPONSES] * 2
    mine = list(range(dp_rank, len(seqs), dp))
    batch = TrainBatch(
        tokens=[seqs[i] for i in mine],
        response_lengths=[lengths[i] for i in mine],
        loss_masks=[[1] * lengths[i] for i in mine],
        per_token=PerToken(advantages=[[1.0 if i % 2 else -1.0] * lengths[i] for i in mine]),
        global_num_tokens=sum(lengths),
        global_num_seqs=len(seqs),
    )
    batch.per_token.rollout_logp = [[0.0] * n for n in batch.response_lengths]
    actor.train_rl(batch)
    temperature = config.rollout.sampling.temperature or 1.0
    before = sample_all(urls, temperature) if info.rank == 0 else None
    sync = actor.push_weights(urls, transport, "v1", sync_dir)
    shared: list = [sample_all(urls, temperature) if info.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)  # every rank scores the engines' samples
    after = shared[0]
    scoring = TrainBatch(
        tokens=[p + tokens for p, (tokens, _) in zip(PROMPTS * len(urls), after, strict=True)],
        response_lengths=[len(tokens) for tokens, _ in after],
        loss_masks=[[1] * len(tokens) for tokens, _ in after],
    )
    trainer = actor.response_logprobs(scoring)
    pids: list = [None] * info.world_size  # the creators of this run's shared-memory segments
    dist.all_gather_object(pids, os.getpid())
    if info.rank == 0:
        assert before is not None
        versions = {
            u: requests.get(f"{u}/get_model_info", timeout=10).json().get("weight_version") for u in urls
        }
        result = {
            "trainer": [trainer.get(i) for i in range(len(after))],
            "engine": [logps for _, logps in after],
            "engine_before": [logps for _, logps in before],
            "versions": versions,
            "sync": sync,
            "pids": pids,
        }
        (out_dir / "rank0.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
