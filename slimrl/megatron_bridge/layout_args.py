"""The parallel layout a conversion runs under, as given on the command line.

Kept free of torch so the launching process, which only waits for its ranks, stays small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slimrl.config.schema import ParallelConfig
from slimrl.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LayoutArgs:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    workers: int = 1
    """Processes that split each pipeline stage's layers between them (extra pipeline stages: a
    torch_dist checkpoint does not depend on the layout that wrote it, so more stages only split
    the work, including Megatron's per-tensor planning, which extra replicas would each repeat)."""

    @property
    def world_size(self) -> int:
        """Smallest world that holds the layout (expert ranks ep*etp must fit in tp*dp), per worker."""
        etp = self.tp if self.etp is None else self.etp
        dp = math.lcm(self.tp, self.ep * etp) // self.tp
        return self.tp * self.pp * dp * self.workers

    def parallel_config(self, num_layers: int) -> ParallelConfig:
        """Any stage count up to the layer count: stages that do not divide the layers get them as
        evenly as they allow (the checkpoint does not depend on the split that wrote it, so any
        layout the trainer accepts, uneven stages included, converts)."""
        stages = self.pp * self.workers
        if stages > num_layers:
            flag = (
                f"--workers {self.workers}: pp*workers = {stages}" if self.workers > 1 else f"--pp {self.pp}:"
            )
            raise ConfigError(
                f"{flag} pipeline stages for only {num_layers} layers (valid: --pp 1 to {num_layers}"
                f"{f', --workers 1 to {max(num_layers // self.pp, 1)}' if self.workers > 1 else ''})"
            )
        uneven = None
        if num_layers % stages:  # as even as the layers allow
            base, extra = divmod(num_layers, stages)
            uneven = [base + (stage < extra) for stage in range(stages)]
        return ParallelConfig(
            tp=self.tp, pp=stages, ep=self.ep, etp=self.etp, use_distributed_optimizer=False, pp_layout=uneven
        )
