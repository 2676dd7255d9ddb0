"""The one object that owns the parallel layout: sizes, their checks, and Megatron's groups.

`ParallelLayout.resolve` turns `parallel.*` plus the world size and the model architecture into
concrete sizes, refusing layouts that cannot work with a one-line error naming the key.
`initialize()` hands the sizes to `megatron.core.parallel_state` exactly once per process.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimrl.config.schema import ParallelConfig
from slimrl.errors import ConfigError
from slimrl.model_arch import ModelArch


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    vpp: int | None
    sequence_parallel: bool
    pp_layout: tuple[int, ...] | None = None

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert weights: the non-pipeline ranks over ep*etp."""
        return self.world_size // self.pp // (self.ep * self.etp)

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int, arch: ModelArch | None) -> ParallelLayout:
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(cfg, key) < 1:
                raise ConfigError(f"parallel.{key}={getattr(cfg, key)}: must be >= 1")
        etp = cfg.tp if cfg.etp is None else cfg.etp  # Megatron-LM's default
        if cfg.ep == 1 and etp != cfg.tp:
            # megatron-core marks expert weights as dense when ep == 1 and reduces them over the
            # dense data-parallel group only: with etp != tp their gradients would silently miss
            # the other tensor-parallel ranks' tokens.
            raise ConfigError(
                f"parallel.etp={etp}: with parallel.ep=1 expert-TP must equal parallel.tp={cfg.tp} "
                f"(or set parallel.ep > 1)"
            )
        sequence_parallel = cfg.tp > 1 if cfg.sequence_parallel is None else cfg.sequence_parallel
        model_ranks = cfg.tp * cfg.pp * cfg.cp
        # The model's own constraints come first: they name the key to change most directly.
        if arch is not None:
            provisional = cls(
                world_size=world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, etp=etp, dp=1,
                vpp=cfg.vpp, sequence_parallel=sequence_parallel,
                pp_layout=tuple(cfg.pp_layout) if cfg.pp_layout else None,
            )  # fmt: skip
            provisional.check_against(arch)
        if cfg.dp is not None:
            if model_ranks * cfg.dp != world_size:
                raise ConfigError(
                    f"parallel.dp={cfg.dp}: tp*pp*cp*dp = {model_ranks * cfg.dp} but the training world "
                    f"size is {world_size} (cluster.num_nodes * cluster.gpus_per_node, minus "
                    f"cluster.rollout_gpus when not colocated)"
                )
        elif world_size % model_ranks:
            raise ConfigError(
                f"parallel.tp={cfg.tp}, parallel.pp={cfg.pp}, parallel.cp={cfg.cp}: tp*pp*cp = {model_ranks} "
                f"does not divide the training world size {world_size}"
            )
        dp = cfg.dp or world_size // model_ranks
        non_pp = world_size // cfg.pp
        if non_pp % (cfg.ep * etp):
            raise ConfigError(
                f"parallel.ep={cfg.ep}, parallel.etp={etp}: ep*etp = {cfg.ep * etp} must divide the "
                f"expert-data world tp*cp*dp = {non_pp}"
            )
        return cls(
            world_size=world_size,
            tp=cfg.tp,
            pp=cfg.pp,
            cp=cfg.cp,
            ep=cfg.ep,
            etp=etp,
            dp=dp,
            vpp=cfg.vpp,
            sequence_parallel=sequence_parallel,
            pp_layout=tuple(cfg.pp_layout) if cfg.pp_layout else None,
        )

    def check_against(self, arch: ModelArch) -> None:
        heads, groups = arch.num_attention_heads, arch.num_query_groups
        if heads % self.tp:
            raise ConfigError(
                f"parallel.tp={self.tp}: must divide the model's {heads} attention heads "
                f"(valid: {_divisors(heads)})"
            )
        if arch.mla is None and groups % self.tp:
            raise ConfigError(
                f"parallel.tp={self.tp}: must divide the model's {groups} query groups "
                f"(num_key_value_heads; valid: {_divisors(groups)})"
            )
        if arch.is_moe and arch.num_experts % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep}: must divide the model's {arch.num_experts} experts "
                f"(valid: {_divisors(arch.num_experts)})"
            )
        if not arch.is_moe and self.ep > 1:
            raise ConfigError(f"parallel.ep={self.ep}: the model ({arch.model_type}) has no experts")
        stages = self.pp * (self.vpp or 1)
        if self.pp_layout is not None:
            if len(self.pp_layout) != stages or sum(self.pp_layout) != arch.num_layers:
                raise ConfigError(
                    f"parallel.pp_layout={list(self.pp_layout)}: needs pp*vpp = {stages} entries summing "
                    f"to the model's {arch.num_layers} layers"
                )
            if min(self.pp_layout) < 1:
                raise ConfigError(f"parallel.pp_layout={list(self.pp_layout)}: every stage needs a layer")
        elif stages > arch.num_layers:
            raise ConfigError(
                f"parallel.pp={self.pp}: pp*vpp = {stages} pipeline stages for only {arch.num_layers} layers"
            )
        elif arch.num_layers % stages:
            raise ConfigError(
                f"parallel.pp={self.pp}: pp*vpp = {stages} does not divide the {arch.num_layers} layers; "
                f"set parallel.pp_layout for uneven stages"
            )
        if self.tp > 1 and arch.is_moe and not self.sequence_parallel:
            raise ConfigError(
                "parallel.sequence_parallel=false: Megatron-Core requires sequence parallelism for MoE "
                "training with tp > 1"
            )

    def initialize(self) -> None:
        """Create Megatron's process groups (torch.distributed must already be initialised)."""
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
