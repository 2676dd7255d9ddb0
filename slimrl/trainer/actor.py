"""`MegatronActor`: everything one training rank does, independent of who launched it.

Ray wraps it as an actor (one per device); `torchrun` workers and tests construct it directly.
The driver never imports Megatron: it only calls these methods.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slimrl.config.schema import SlimConfig
from slimrl.devices.ledger import Ledger
from slimrl.errors import SlimError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.megatron_bridge.dist_ckpt import load_model
from slimrl.megatron_bridge.loading import load_hf_into_megatron
from slimrl.megatron_bridge.megatron_config import BuildOptions
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout
from slimrl.trainer import losses, ppo, rl, weight_sync
from slimrl.trainer.batch import TrainBatch, digest_problem
from slimrl.trainer.checkpoint import load_train_state, save_train_state
from slimrl.trainer.critic import Critic
from slimrl.trainer.distributed import RankInfo, check_groups_against_ledger, init_distributed, use_cuda
from slimrl.trainer.hf_export import HF_DIR, save_hf
from slimrl.trainer.model import TrainState, build_gpt_chunks, build_options, build_train_state, freeze
from slimrl.trainer.numerics import agreed_first
from slimrl.trainer.offload import Offloader, _bytes_of, _storages
from slimrl.trainer.rank_api import ProbeScore
from slimrl.trainer.step import StepRunner
from slimrl.trainer.weight_store import WeightStore

if TYPE_CHECKING:
    from slimrl.trainer.routing_replay import RoutingReplay

logger = logging.getLogger(__name__)


class MegatronActor:
    def __init__(self, config: SlimConfig, rank_info: RankInfo, ledger: Ledger | None = None) -> None:
        self.config = config
        self.rank_info = rank_info
        self.ledger = ledger
        """The run's device ledger (the driver's); None outside a run (torchrun workers, tools)."""
        self.arch: ModelArch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
        self.layout = ParallelLayout.resolve(config.parallel, config.train_world_size(), self.arch)
        self.state: TrainState | None = None
        self.options: BuildOptions | None = None
        self.weights: WeightStore | None = None
        self.offloader: Offloader | None = None
        self.critic: Critic | None = None
        """The PPO value model on the same ranks (`advantage_estimator: ppo` only)."""
        self.routing: RoutingReplay | None = None
        """MoE routing replay of the policy (`algorithm.routing_replay` only)."""
        self.steps_done = 0
        self._runner: StepRunner | None = None
        self._warned_unmapped = False

    # ---------------------------------------------------------------- set-up
    def setup(self, total_steps: int) -> dict[str, Any]:
        """Join the process group, build the model (and its optimizer), return a summary."""
        init_distributed(self.rank_info, self.layout, self.config.run.seed)
        if self.ledger is not None:
            check_groups_against_ledger(self.ledger, self.rank_info.rank)
        options = self.options = build_options(self.config, use_cuda())
        chunks = build_gpt_chunks(self.arch, self.layout, options, self.config.train.max_seq_len)
        if self.config.model.init_from_hf:
            load_hf_into_megatron(chunks, self.arch, self.layout, self.config.model.hf_checkpoint)
        if self.config.model.load:  # e.g. an SFT run's checkpoint: its weights, not its optimizer
            load_model(chunks, Path(self.config.model.load))
        num_frozen = freeze(chunks, self.config.train.frozen_params)
        if options.routing_replay:
            from slimrl.trainer.routing_replay import RoutingReplay

            if self.layout.cp > 1:
                raise SlimError("algorithm.routing_replay=true needs parallel.cp=1 (context parallel: no)")
            self.routing = RoutingReplay(chunks, self.arch, self.layout.sequence_parallel)
        self.state = build_train_state(self.config, chunks, options, total_steps)
        self._runner = StepRunner(
            self.config, self.layout, options, self.state, self.routing, self.rank_info.rank
        )
        self.weights = WeightStore(self.state.model)
        algo = self.config.algorithm
        if algo.loss == "policy" and (algo.kl_loss_coef > 0 or algo.kl_coef > 0):
            self._save_reference(chunks)
        self.offloader = Offloader(self.state.model, self.state.optimizer)
        num_params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        summary = {"rank": self.rank_info.rank, "local_params": num_params, "frozen": num_frozen}
        if self.config.has_critic():
            self.critic = Critic.build(self.config, self.arch, self.layout, options, chunks, total_steps)
            summary["critic_local_params"] = self.critic.num_params
        return summary

    def _save_reference(self, chunks: list[Any]) -> None:
        """The KL reference, kept in host memory: the initial policy, or the weights of
        `model.ref_load` (a Megatron checkpoint, any layout) loaded in and swapped back out."""
        assert self.weights is not None
        ref_load = self.config.model.ref_load
        if ref_load is None:
            self.weights.save("ref")
            return
        self.weights.save("policy")
        load_model(chunks, Path(ref_load))
        self.weights.save("ref")
        self.weights.load("policy")
        del self.weights.slots["policy"]

    # ---------------------------------------------------------------- helpers
    @property
    def _chunks(self) -> list[Any]:
        assert self.state is not None, "setup() first"
        return self.state.model

    @property
    def runner(self) -> StepRunner:
        assert self._runner is not None, "setup() first"
        return self._runner

    # ---------------------------------------------------------------- training
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch."""
        from megatron.core import parallel_state as mpu

        assert self.state is not None, "setup() first"
        start = time.perf_counter()

        dp = self.layout.dp * self.layout.cp

        def loss_for(num_micro_batches: int):
            scale = losses.loss_scale(num_micro_batches, dp, batch.global_num_tokens)
            return lambda mb, output: losses.sft_loss(output, mb.loss_mask_BS, scale)

        result = self.runner.optimizer_step(batch, loss_for)
        self.steps_done += 1
        metrics: dict[str, float] = {
            "grad_norm": result.grad_norm,
            "lr": self.state.optimizer.param_groups[0]["lr"],
            "update_ok": float(result.applied),
            "skipped_steps": float(self.runner.skipped_steps),
            "oom_retries": float(self.runner.oom_retries),
            "seconds": time.perf_counter() - start,
        }
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            summed = self.runner.summed_reports(result.reports)
            metrics["loss"] = summed["loss_sum"] / max(summed["tokens"], 1.0)
            metrics["tokens"] = summed["tokens"]
        return metrics

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """Logprob passes, advantages and `train.steps_per_rollout` policy updates."""
        found = agreed_first(digest_problem(batch))  # every rank refuses together (no rank hangs)
        if found is not None:
            raise SlimError(f"trainer rank {found[0]}: {found[1]}")
        self.steps_done += 1
        # PPO: GAE on the critic's values, then critic and policy steps
        return (ppo if self.critic is not None else rl).train_rollout(self, batch)

    def response_logprobs(self, batch: TrainBatch) -> dict[int, list[float]]:
        """Per-sample response logprobs under the current weights (last pipeline stage only)."""
        return rl.response_logprobs(self, batch)["logprobs"]

    def probe_logprobs(self, tokens: list[int]) -> ProbeScore:
        """Logprobs of `tokens[1:]` under the current weights, the update check's probe: every rank
        runs it (one sequence per DP rank), the last pipeline stage answers the logprobs. The
        routers choose for themselves (no engine routing to replay: the engines are not updated
        yet when the probe runs) and report how close each choice was (`router_margins.py`)."""
        from slimrl.trainer.router_margins import ROUTER_TIE, RouterMargins

        n = len(tokens) - 1
        probe = TrainBatch(tokens=[tokens], response_lengths=[n], loss_masks=[[1] * n])
        assert self.state is not None
        margins = RouterMargins(self.state.model, self.layout.sequence_parallel) if self.arch.is_moe else None
        if self.routing is not None:
            self.routing.enabled = False
        self.runner.margins = margins
        try:
            with margins.recording() if margins is not None else contextlib.nullcontext():
                logprobs = self.response_logprobs(probe).get(0)
        finally:
            self.runner.margins = None
            if self.routing is not None:
                self.routing.enabled = True
        if margins is not None and margins.unmapped and not self._warned_unmapped:
            self._warned_unmapped = True
            logger.warning("update check: router margins unknown in this layout: the probe compares all")
        if margins is None or margins.unmapped:
            return ProbeScore(logprobs)
        ties = [position for position, margin in margins.smallest.items() if margin < ROUTER_TIE]
        return ProbeScore(logprobs, margins.smallest, min(ties, default=None))

    # ---------------------------------------------------------------- weight sync
    def push_weights(
        self,
        urls: list[str],
        transport: str,
        version: str,
        sync_dir: str | None = None,
        trace_dir: str | None = None,
    ) -> dict[str, float]:
        """Stream the current weights (HF names) to every rollout engine."""
        rollout = self.config.rollout
        return weight_sync.push_weights(
            self, urls, transport, version, sync_dir, rollout.api_key, rollout.admin_api_key, trace_dir,
        )  # fmt: skip

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str) -> None:
        save_train_state(self, Path(directory))
        if self.config.checkpoint.save_hf:
            save_hf(self, Path(directory) / HF_DIR)

    def load_checkpoint(self, directory: str) -> int:
        load_train_state(self, Path(directory))
        return self.steps_done

    # ---------------------------------------------------------------- memory
    def offload(self, keep_params: bool = False) -> int:
        """Give the device back to the rollout engines (colocated runs); with `keep_params` the
        parameters stay for the weight sync."""
        assert self.offloader is not None
        freed = self.offloader.offload(keep_params)
        if self.critic is not None:  # never synced to the engines: its parameters go at once
            freed += self.critic.offloader.offload()
        return freed

    def onload(self) -> None:
        assert self.offloader is not None
        self.offloader.onload()
        if self.critic is not None:
            self.critic.offloader.onload()

    def state_digests(self) -> dict[str, str]:
        """sha256 of parameters, gradient buffers and optimizer state: an offload/onload cycle
        must leave every byte unchanged."""
        assert self.state is not None
        states = [self.state] + ([self.critic.state] if self.critic is not None else [])
        storages = [s for state in states for s in _storages(state.model, state.optimizer)]
        return {
            str(i): hashlib.sha256(_bytes_of(s).clone().numpy().tobytes()).hexdigest()  # clone: numpy() pins
            for i, s in enumerate(storages)
        }

    # ---------------------------------------------------------------- inspection
    def coordinates(self) -> dict[str, int]:
        from megatron.core import parallel_state as mpu

        return {
            "rank": self.rank_info.rank,
            "tp": mpu.get_tensor_model_parallel_rank(),
            "pp": mpu.get_pipeline_model_parallel_rank(),
            "ep": mpu.get_expert_model_parallel_rank(),
            "dp": mpu.get_data_parallel_rank(),
        }

    def param_digests(self) -> dict[str, str]:
        """sha256 of every local parameter: DP replicas must hold identical bytes."""
        digests = {}
        for index, chunk in enumerate(self._chunks):
            for name, param in chunk.module.named_parameters():
                data = param.detach().to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes()
                digests[f"{index}/{name}"] = hashlib.sha256(data).hexdigest()
        return digests
