"""torchrun worker for MoE routing replay: score and train a fixed batch under given routings.

Usage: torchrun --nproc-per-node N tests/dist/replay_worker.py OUT_DIR DATA key=value ...
DATA (torch.save) holds `tokens`, `response_lengths`, `rollout_log_probs` and routings by name
(`own`, `permuted`, `engine`: per sequence `(len - 1, layers, top_k)` uint8). Each rank writes
OUT_DIR/rank<k>.json: per routing the replayed response logprobs (`replay/<name>`), the
disagreement of a scoring pass, the logprobs without replay (`free`), and the metrics of one RL
step on the `permuted` routing (reference model replaying too, through the KL loss; with
`algorithm.routing_replay_counterfactual=true` also the mismatch without replay against
`rollout_log_probs`). First of all, the update check's probe of DATA's `probe` tokens (`probe`:
logprobs, router margins by position, first near tie).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter

from slimrl import estimators
from slimrl.preflight import load_config
from slimrl.trainer import rl
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import PerToken, TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def rank_batch(data: dict, routing: str, dp: int, dp_rank: int, key: str = "advantages") -> TrainBatch:
    """`key`: "scores" for a token-level estimator (the trainer computes the advantages)."""
    count = len(data["tokens"])
    mine = list(range(dp_rank, count, dp))
    responses = data["response_lengths"]
    return TrainBatch(
        tokens=[data["tokens"][i] for i in mine],
        response_lengths=[responses[i] for i in mine],
        loss_masks=[[1] * responses[i] for i in mine],
        per_token=PerToken(
            rollout_logp=[data["rollout_log_probs"][i] for i in mine],
            **{key: [[1.0 if i % 2 == 0 else -1.0] * responses[i] for i in mine]},
        ),
        global_num_tokens=sum(responses),
        global_num_seqs=count,
        routed_experts=[np.asarray(data[routing][i]) for i in mine],
        sample_indices=mine,
    )


def by_sample(batch: TrainBatch, logprobs: dict[int, list[float]]) -> dict[str, list[float]]:
    return {str(batch.sample_indices[k]): v for k, v in logprobs.items()}


def main() -> None:
    out_dir, data_path = Path(sys.argv[1]), sys.argv[2]
    config = load_config(None, sys.argv[3:])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=2)
    assert actor.routing is not None
    dp, dp_rank = actor.layout.dp, actor.coordinates()["dp"]
    data = torch.load(data_path, weights_only=False)
    result: dict = {"coords": actor.coordinates()}
    # the update check's probe first: its routers choose for themselves and record their margins,
    # and routing replay must be back in place for everything below
    probe = actor.probe_logprobs(data["probe"])
    result["probe"] = {"logprobs": probe.logprobs, "margins": probe.margins, "tie_at": probe.tie_at}
    for routing in ("own", "permuted", "engine"):
        batch = rank_batch(data, routing, dp, dp_rank)
        actor.routing.measure_next = True
        result[f"replay/{routing}"] = by_sample(batch, actor.response_logprobs(batch))
        result[f"disagreement/{routing}"] = rl.routing_disagreement(actor)["train/routing_disagreement"]
    actor.routing.enabled = False
    result["free"] = by_sample(batch, actor.response_logprobs(batch))
    actor.routing.enabled = True
    key = "scores" if estimators.traits(config.algorithm.advantage_estimator).token_level else "advantages"
    result["metrics"] = actor.train_rl(rank_batch(data, "permuted", dp, dp_rank, key))
    if actor.critic is not None:  # PPO: the critic's routers must choose for themselves
        result["critic_replaying_routers"] = sum(
            1
            for chunk in actor.critic.state.model
            for module in chunk.modules()
            if isinstance(module, TopKRouter) and module.router_replay is not None
        )
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
