"""torchrun worker: Megatron's own loader reads a torch_dist checkpoint into one parallel layout.

Usage: torchrun --nproc-per-node N tests/dist/load_worker.py OUT_DIR CKPT_DIR key=value ...
Each rank writes OUT_DIR/rank<k>.json with the digests of its parameters as loaded from the HF
checkpoint (our loader) and then from CKPT_DIR (`dist_checkpointing.load`).
"""

import json
import sys
from pathlib import Path

import torch

from slimrl.preflight import load_config
from slimrl.megatron_bridge.dist_ckpt import load_model
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def main() -> None:
    out_dir, ckpt = Path(sys.argv[1]), Path(sys.argv[2])
    config = load_config(None, sys.argv[3:])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=1)  # model.init_from_hf: the weights come from the HF checkpoint
    from_hf = actor.param_digests()
    for chunk in actor._chunks:  # nothing of the HF load may survive into the comparison
        for param in chunk.parameters():
            param.data.fill_(torch.nan)
    load_model(actor._chunks, ckpt)
    result = {"coords": actor.coordinates(), "from_hf": from_hf, "from_ckpt": actor.param_digests()}
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
