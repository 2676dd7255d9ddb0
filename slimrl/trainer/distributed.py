"""Process start-up for a training rank: CPU compat, torch.distributed, Megatron groups, seeds.

The same function serves a Ray actor (rank/world passed in), a `torchrun` worker (read from the
environment) and the conversion CLIs, so every entry point initialises identically.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from slimrl.devices.ledger import Ledger
from slimrl.errors import SlimError
from slimrl.parallel_layout import ParallelLayout
from slimrl.utils.net import bound_tcp_store


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> RankInfo:
        """Read what torchrun / srun put in the environment."""
        env = os.environ
        rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
        world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
        return cls(
            rank=rank,
            world_size=world,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            local_rank=int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0))),
        )


def use_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def init_distributed(info: RankInfo, layout: ParallelLayout, seed: int, timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed and Megatron's parallel groups, then seed every RNG."""
    from slimrl.compat import megatron_cpu

    megatron_cpu.apply()  # no-op on GPU machines
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if use_cuda():
            torch.cuda.set_device(info.local_rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Rank 0's store listens on master_addr only (multi-node Slurm, docs/slurm.md); under
        # torchrun its agent already serves the store there and every rank is a client.
        serves = info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = bound_tcp_store(info.master_addr, info.master_port, info.world_size, serves, timeout)
        dist.init_process_group(
            backend="nccl" if use_cuda() else "gloo",
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
        )
    layout.initialize()
    seed_everything(seed)


def check_groups_against_ledger(ledger: Ledger, rank: int) -> None:
    """The groups Megatron built on this rank are the ledger's, on which the GPU's rules were
    checked before anything started (`slimrl/devices`): its rank arithmetic is ours, verified."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    built = {
        "tensor_parallel": mpu.get_tensor_model_parallel_group(),
        "pipeline_parallel": mpu.get_pipeline_model_parallel_group(),
        "context_parallel": mpu.get_context_parallel_group(),
        "data_parallel": mpu.get_data_parallel_group(with_context_parallel=True),
        "model_parallel": mpu.get_model_parallel_group(),
        "expert_parallel": mpu.get_expert_model_parallel_group(),
        "expert_tensor_parallel": mpu.get_expert_tensor_parallel_group(),
        "expert_data_parallel": mpu.get_expert_data_parallel_group(),
        "expert_model_parallel": mpu.get_expert_tensor_and_model_parallel_group(),
        "embedding": mpu.get_embedding_group(),
    }
    me = f"trainer/{rank}"
    for purpose, group in built.items():
        actual = tuple(f"trainer/{r}" for r in dist.get_process_group_ranks(group))
        expected = next((g.members for g in ledger.groups if g.purpose == purpose and me in g.members), (me,))
        if actual != expected:
            raise SlimError(
                f"rank {rank}: Megatron's {purpose} group is {list(actual)}, the device ledger's "
                f"{list(expected)}; the GPU rules were checked on the ledger's"
            )


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
