"""torchrun worker for the RL trainer: build the tiny policy, run scenario steps, dump results.

Usage: torchrun --nproc-per-node N tests/dist/rl_worker.py OUT_DIR SCENARIO key=value ...
Scenarios: `steps` (rollout logprobs taken from the trainer itself, two RL updates),
`offload` (digests around an offload/onload cycle, then one update), `nonfinite` (NaN gradients
injected at optimizer steps 2, 4 and 5 by the fault point; digests around each step, the error that
stops the run, then a non-finite parameter refused before a weight sync).
Each rank writes OUT_DIR/rank<k>.json; rank 0 also saves the final weights to OUT_DIR/weights.pt.
With `checkpoint.save_hf=true` the ranks then save a checkpoint to OUT_DIR/ckpt.
"""

import json
import os
import random
import sys
from pathlib import Path

import torch

from slimrl import estimators
from slimrl.preflight import load_config
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import PerToken, TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def make_batch(vocab: int, dp: int, dp_rank: int, key: str = "advantages") -> TrainBatch:
    """`key`: "scores" for a token-level estimator (the trainer computes the advantages)."""
    rng = random.Random(0)
    sequences = [[rng.randrange(3, vocab) for _ in range(rng.randrange(10, 30))] for _ in range(8)]
    responses = [rng.randrange(3, len(s) - 2) for s in sequences]
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(8)]
    mine = list(range(dp_rank, 8, dp))
    return TrainBatch(
        tokens=[sequences[i] for i in mine],
        response_lengths=[responses[i] for i in mine],
        loss_masks=[[1] * responses[i] for i in mine],
        per_token=PerToken(**{key: [[advantages[i]] * responses[i] for i in mine]}),
        global_num_tokens=sum(responses),
        global_num_seqs=8,
    )


def nonfinite(actor: MegatronActor, batch: TrainBatch, result: dict) -> None:
    from slimrl.errors import SlimError
    from slimrl.trainer.numerics import weights_fingerprint
    from slimrl.utils import faults

    os.environ[faults.NONFINITE_GRAD] = "2,4,5"

    def weights() -> list[torch.Tensor]:
        return [p.detach().clone() for chunk in actor.state.model for p in chunk.parameters()]

    steps = []
    for _ in range(5):
        before = weights()
        try:
            metrics = actor.train_rl(batch)
        except SlimError as exc:
            steps.append({"error": str(exc)})
            break
        changed = any(not torch.equal(a, b) for a, b in zip(before, weights(), strict=True))
        steps.append({"metrics": metrics, "changed": changed})
    result["steps"] = steps
    with torch.no_grad():
        next(actor.state.model[0].parameters()).view(-1)[3] = float("inf")
    try:
        weights_fingerprint(actor.state.model)
    except SlimError as exc:
        result["push_error"] = str(exc)


def main() -> None:
    out_dir, scenario = Path(sys.argv[1]), sys.argv[2]
    config = load_config(None, sys.argv[3:])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=4)
    coords = actor.coordinates()
    key = "scores" if estimators.traits(config.algorithm.advantage_estimator).token_level else "advantages"
    batch = make_batch(actor.arch.vocab_size, actor.layout.dp, coords["dp"], key)
    rollout_lp = actor.response_logprobs(batch)  # as an exactly on-policy engine would report them
    batch.per_token.rollout_logp = [
        rollout_lp.get(i, [0.0] * n) for i, n in enumerate(batch.response_lengths)
    ]
    result = {"coords": coords, "rollout_logprobs": {str(k): v for k, v in rollout_lp.items()}}
    if scenario == "offload":  # one update first, so Adam's state exists and is offloaded too
        result["metrics"] = [actor.train_rl(batch)]
        before = actor.state_digests()
        freed = actor.offload()
        result["freed_bytes"] = freed
        result["sizes_while_offloaded"] = sum(
            p.untyped_storage().nbytes() for p in actor.state.model[0].parameters()
        )
        actor.onload()
        result["digests_equal"] = before == actor.state_digests()
    if scenario == "nonfinite":
        nonfinite(actor, batch, result)
        (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
        destroy_distributed()
        return
    result["metrics"] = [
        *result.get("metrics", []),
        *[actor.train_rl(batch) for _ in range(2 if scenario == "steps" else 1)],
    ]
    result["after_logprobs"] = {str(k): v for k, v in actor.response_logprobs(batch).items()}
    if config.checkpoint.save_hf:  # the checkpoint's hf/ directory, written by every rank together
        (out_dir / "ckpt").mkdir(exist_ok=True)
        actor.save_checkpoint(str(out_dir / "ckpt"))
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    if info.rank == 0:
        weights = {n: p.detach().clone() for n, p in actor.state.model[0].module.named_parameters()}
        torch.save(weights, out_dir / "weights.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
