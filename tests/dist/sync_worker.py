"""torchrun worker: train one RL step, push the weights to running engines, score fixed samples.

Usage: torchrun ... tests/dist/sync_worker.py OUT_DIR TRANSPORT ENGINE_URLS(comma) SYNC_DIR key=value ...
Rank 0 writes OUT_DIR/rank0.json with the trainer's logprobs of the samples (after the update)
and the engines' logprobs of the same samples (scored by /generate with max_new_tokens 0).
"""

import json
import sys
from pathlib import Path

import requests

from slimrl.config import load_config
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
RESPONSES = [[20, 21, 22], [23], [24, 25]]


def engine_logprobs(url: str, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    body = {
        "input_ids": prompt + response,
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
    }
    meta = requests.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    triples = meta["input_token_logprobs"]
    return [t[0] for t in triples[-len(response) :]]


def main() -> None:
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
        per_token={"advantages": [[1.0 if i % 2 else -1.0] * lengths[i] for i in mine]},
        global_num_tokens=sum(lengths),
        global_num_seqs=len(seqs),
    )
    batch.per_token["rollout_log_probs"] = [[0.0] * n for n in batch.response_lengths]
    actor.train_rl(batch)
    sync = actor.push_weights(urls, transport, "v1", sync_dir)
    scoring = TrainBatch(
        tokens=[p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)],
        response_lengths=[len(r) for r in RESPONSES],
        loss_masks=[[1] * len(r) for r in RESPONSES],
    )
    trainer = actor.response_logprobs(scoring)
    if info.rank == 0:
        temperature = config.rollout.sampling.temperature or 1.0
        engines = {
            u: [engine_logprobs(u, p, r, temperature) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
            for u in urls
        }
        versions = {
            u: requests.get(f"{u}/get_model_info", timeout=10).json().get("weight_version") for u in urls
        }
        result = {
            "trainer": [trainer.get(i) for i in range(len(PROMPTS))],
            "engines": engines,
            "versions": versions,
            "sync": sync,
        }
        (out_dir / "rank0.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
