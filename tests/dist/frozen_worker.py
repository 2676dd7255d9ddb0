"""torchrun worker: one RL step with frozen parameters (and the optimizer CPU-offload setting).

Usage: torchrun --nproc-per-node N tests/dist/frozen_worker.py OUT_DIR key=value ...
Each rank writes OUT_DIR/rank<k>.json: `{"frozen": n, "unchanged": [...], "changed": [...],
"optimizers": [class names]}` (parameter names as Megatron's, unchanged = bitwise equal).
"""

import json
import random
import sys
from pathlib import Path

import torch

from slimrl.preflight import load_config
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import PerToken, TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def make_batch(vocab: int) -> TrainBatch:
    rng = random.Random(0)
    tokens = [[rng.randrange(3, vocab) for _ in range(rng.randrange(12, 30))] for _ in range(6)]
    responses = [len(t) // 2 for t in tokens]
    return TrainBatch(
        tokens=tokens,
        response_lengths=responses,
        loss_masks=[[1] * n for n in responses],
        per_token=PerToken(advantages=[[1.0 if i % 2 else -1.0] * n for i, n in enumerate(responses)]),
        global_num_tokens=sum(responses),
        global_num_seqs=len(tokens),
    )


def main() -> None:
    out_dir = Path(sys.argv[1])
    config = load_config(None, sys.argv[2:])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    summary = actor.setup(total_steps=1)
    params = dict(actor.state.model[0].module.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    actor.train_rl(make_batch(actor.arch.vocab_size))
    unchanged = sorted(n for n, p in params.items() if torch.equal(p.detach(), before[n]))
    optimizers = getattr(actor.state.optimizer, "chained_optimizers", [actor.state.optimizer])
    result = {
        "frozen": summary["frozen"],
        "requires_grad": {n: p.requires_grad for n, p in params.items()},
        "unchanged": unchanged,
        "changed": sorted(set(params) - set(unchanged)),
        "optimizers": [type(getattr(o, "optimizer", o)).__name__ for o in optimizers],
    }
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
