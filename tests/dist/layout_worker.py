"""torchrun worker: train the tiny model a few steps on a fixed batch under one parallel layout.

Usage: torchrun --nproc-per-node N tests/dist/layout_worker.py OUT_DIR key=value ...
Each rank writes OUT_DIR/rank<k>.json with its losses, coordinates and parameter digests.
"""

import json
import random
import sys
from pathlib import Path

from slimrl.preflight import load_config
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def fixed_batch(num_seqs: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(12, 33))] for _ in range(num_seqs)]


def main() -> None:
    out_dir = Path(sys.argv[1])
    overrides = sys.argv[2:]
    config = load_config(None, overrides)
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    steps = config.train.num_steps
    actor.setup(total_steps=steps)
    coords = actor.coordinates()
    sequences = fixed_batch(8, actor.arch.vocab_size)
    response_lengths = [len(s) // 2 for s in sequences]
    masks = [[1] * r for r in response_lengths]
    dp, dp_rank = actor.layout.dp, coords["dp"]
    mine = list(range(dp_rank, len(sequences), dp))
    batch = TrainBatch(
        tokens=[sequences[i] for i in mine],
        response_lengths=[response_lengths[i] for i in mine],
        loss_masks=[masks[i] for i in mine],
        global_num_tokens=sum(response_lengths),
        global_num_seqs=len(sequences),
    )
    history = [actor.train_step(batch) for _ in range(steps)]
    result = {"coords": coords, "metrics": history, "digests": actor.param_digests()}
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
