"""torchrun worker: build one rank's model, DDP buffers and optimizer, take one step, and report
what they really hold, for comparison with `slimrl.planning.memory_plan`.

Usage: torchrun --nproc-per-node N tests/dist/param_count_worker.py OUT_DIR key=value ...
Each rank writes OUT_DIR/rank<k>.json: its coordinates, parameter elements, DDP grad-buffer bytes
and optimizer-state bytes (Adam state tensors, their `step` counters, fp32 main-param copies).
The step matters: torch's Adam allocates its state lazily, at the first step.
"""

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from slimrl.preflight import load_config
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def one_batch(actor: MegatronActor, dp_rank: int) -> TrainBatch:
    """Four short random sequences, this rank's data-parallel share of them."""
    rng = random.Random(0)
    sequences = [[rng.randrange(actor.arch.vocab_size) for _ in range(16)] for _ in range(4)]
    mine = sequences[dp_rank :: actor.layout.dp]
    return TrainBatch(
        tokens=mine,
        response_lengths=[8] * len(mine),
        loss_masks=[[1] * 8 for _ in mine],
        global_num_tokens=8 * len(sequences),
        global_num_seqs=len(sequences),
    )


def grad_buffer_bytes(model: list[Any]) -> int:
    """Every DDP buffer's grad storage (dense and expert-parallel), padding included."""
    buffers = [b for chunk in model for b in (*chunk.buffers, *chunk.expert_parallel_buffers)]
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes(optimizer: Any) -> dict[str, int]:
    """State of a (possibly chained) Megatron optimizer: the torch optimizer's state tensors
    (Adam's exp_avg/exp_avg_sq, and the per-parameter `step` counters) and the fp32 main-param
    copies Megatron keeps of non-fp32 parameters (none for fp32 models: those step in place)."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    adam = steps = main = 0
    for opt in inner:
        for state in opt.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    size = value.numel() * value.element_size()
                    steps, adam = (steps + size, adam) if key == "step" else (steps, adam + size)
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            main += sum(_nbytes(group) for group in getattr(opt, attr, None) or [])
    return {"adam": adam, "step": steps, "main_params": main}


def main() -> None:
    out_dir = Path(sys.argv[1])
    config = load_config(None, sys.argv[2:])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=1)
    coords = actor.coordinates()
    assert actor.state is not None
    model = actor.state.model
    num_params = sum(p.numel() for chunk in model for p in chunk.module.parameters())
    actor.train_step(one_batch(actor, coords["dp"]))
    result = {
        "coords": coords,
        "num_params": num_params,
        "grad_bytes": grad_buffer_bytes(model),
        "optimizer": optimizer_bytes(actor.state.optimizer),
    }
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
