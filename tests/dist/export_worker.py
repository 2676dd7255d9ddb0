"""torchrun worker: load an HF checkpoint into a sharded model, stream it back out in buckets.

Usage: torchrun --nproc-per-node N tests/dist/export_worker.py OUT_DIR HF_DIR BUCKET_BYTES FP8 key=value ...
Each rank saves what it owns to OUT_DIR/rank<k>.safetensors and writes rank<k>.json with bucket sizes.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimrl.preflight import load_config
from slimrl.megatron_bridge.export import export_hf_buckets
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def main() -> None:
    out_dir, hf_dir, bucket_bytes, fp8 = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    config = load_config(None, [f"model.hf_checkpoint={hf_dir}", *sys.argv[5:]])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=1)
    owned: dict[str, torch.Tensor] = {}
    sizes = []
    for bucket in export_hf_buckets(actor.state.model, actor.arch, actor.layout, bucket_bytes, fp8=fp8):
        sizes.append([sum(t.numel() * t.element_size() for _, t in bucket), len(bucket)])
        for name, tensor in bucket:
            assert name not in owned, name
            owned[name] = tensor.contiguous()
    if owned:
        save_file(owned, str(out_dir / f"rank{info.rank}.safetensors"))
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps({"buckets": sizes, "names": sorted(owned)}))
    destroy_distributed()


if __name__ == "__main__":
    main()
