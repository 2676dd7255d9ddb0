"""The PPO critic: a Megatron value model trained beside the policy, on the same ranks and layout.

The critic is the policy's model built by the same code (`model.build_gpt_chunks(value_head=True)`:
same TP/PP/VPP/EP layout, distributed optimizer) with a scalar `ValueHead` where the LM head was,
its own optimizer and learning rate (`critic.lr`), its own offloader, and its own `critic/`
directory inside every checkpoint (`checkpoint.py`). Its body starts as a copy of the policy's
initial weights and its head at zero, or from `critic.load`.

Values are aligned like logprobs (`batch.py`): the value at a response token is V(s_t), the value of
the state in which the policy emitted that token (the hidden state of the position before it).

Shapes: B = rows of a micro-batch, S = positions.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slimrl.megatron_bridge.dist_ckpt import load_model
from slimrl.trainer import algorithms as alg
from slimrl.trainer.model import TrainState, build_gpt_chunks, build_train_state
from slimrl.trainer.offload import Offloader
from slimrl.trainer.rl import last_pipeline_stage
from slimrl.trainer.step import token_means

if TYPE_CHECKING:
    from slimrl.config.schema import SlimConfig
    from slimrl.megatron_bridge.megatron_config import BuildOptions
    from slimrl.model_arch import ModelArch
    from slimrl.parallel_layout import ParallelLayout
    from slimrl.trainer.actor import MegatronActor
    from slimrl.trainer.batch import MicroBatch, TrainBatch

"""Per-token keys of a PPO batch: values before the update, GAE returns, rewards per token."""
HEAD_PREFIX = "output_layer."


def _copy_body(source_chunks: list[Any], target_chunks: list[Any]) -> None:
    """Every critic parameter except the value head takes the policy's value (same names, same
    layout, so each rank copies its own shards)."""
    with torch.no_grad():
        for source, target in zip(source_chunks, target_chunks, strict=True):
            policy = dict(getattr(source, "module", source).named_parameters())
            for name, param in target.named_parameters():
                if not name.startswith(HEAD_PREFIX):
                    param.copy_(policy[name])


class Critic:
    """What the critic holds on one rank: its training state and offloader."""

    def __init__(self, config: SlimConfig, state: TrainState) -> None:
        self.config = config
        self.state = state
        self.offloader = Offloader(state.model, state.optimizer)

    @classmethod
    def build(
        cls,
        config: SlimConfig,
        arch: ModelArch,
        layout: ParallelLayout,
        options: BuildOptions,
        policy_chunks: list[Any],
        total_steps: int,
    ) -> Critic:
        settings = config.critic
        # The engine's routing was chosen by the policy's routers, not the critic's: no replay.
        options = dataclasses.replace(options, routing_replay=False)
        chunks = build_gpt_chunks(arch, layout, options, config.train.max_seq_len, value_head=True)
        if settings.load:
            load_model(chunks, Path(settings.load))
        else:
            _copy_body(policy_chunks, chunks)
        assert settings.lr is not None, "config checks require critic.lr with ppo"
        opt = dataclasses.replace(config.train.optimizer, lr=settings.lr, min_lr=settings.min_lr)
        return cls(config, build_train_state(config, chunks, options, total_steps, opt))

    @property
    def num_params(self) -> int:
        return sum(p.numel() for chunk in self.state.model for p in chunk.module.parameters())

    # ---------------------------------------------------------------- passes
    def values(self, actor: MegatronActor, batch: TrainBatch) -> dict[int, list[float]]:
        """Forward-only: per-sample values of the response tokens (last pipeline stage only)."""

        def keep(mb: MicroBatch, output: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"values": output[..., 0].float()}

        return actor.runner.forward_only(batch, keep, self.state).get("values", {})

    def train_step(
        self, actor: MegatronActor, batch: TrainBatch, fused: bool
    ) -> tuple[dict[str, float], dict[int, list[float]]]:
        """One optimizer step of the clipped value loss (`algorithms.value_loss`) on `batch`.

        Unfused, the batch carries `old_values` (from `values`) and `returns` (GAE). Fused, with one
        step per rollout, the old values are this forward's own values, detached (the critic being
        trained is the one the rollout is scored with, so the value clip is inactive, as in PPO's
        first mini-batch), and GAE runs on them per micro-batch from `token_rewards`: a whole
        forward-only pass is saved. Returns the metrics and, fused, the unwhitened advantages of
        each sequence (last pipeline stage; empty elsewhere).
        """
        start = time.perf_counter()
        state, algo, clip = self.state, self.config.algorithm, self.config.critic.value_clip
        local_tokens = float(sum(sum(m) for m in batch.loss_masks))
        global_tokens = actor.runner.sum_over_dp({"tokens": local_tokens})["tokens"]
        advantages: dict[int, list[float]] = {}

        def loss_fn(mb: MicroBatch, output: torch.Tensor, megatron_scale: int):
            values = output[..., 0].float()
            mask = mb.loss_mask_BS
            if fused:
                old = values.detach()
                adv, returns = alg.gae_vectorised(
                    mb.per_token_BS.token_rewards, old, mask, algo.gamma, algo.lambd, mb.seq_index_BS
                )
                advantages.update(mb.per_sequence(adv))
            else:
                old, returns = mb.per_token_BS.old_values, mb.per_token_BS.returns
            loss, stats = alg.value_loss(values, old, returns, mask, clip, global_tokens)
            tokens = mask.sum()
            report = {
                "value_loss": loss.detach(),
                "tokens": tokens,
                "vf_clipfrac_sum": stats["value_clipfrac"] * tokens,
                "values_sum": (old * mask).sum(),
                "returns_sum": (returns * mask).sum(),
            }
            return loss * megatron_scale, {k: v.detach().clone() for k, v in report.items()}

        result = actor.runner.optimizer_step(
            batch, actor.runner.megatron_scaled(loss_fn), state=state, with_labels=False
        )
        metrics = {
            "train/critic_grad_norm": result.grad_norm,
            "train/critic_lr": state.optimizer.param_groups[0]["lr"],
        }
        if last_pipeline_stage():
            metrics.update(token_means(actor.runner.summed_reports(result.reports), "train/"))
        metrics["perf/critic_seconds"] = time.perf_counter() - start
        advantages.pop(-1, None)
        return metrics, advantages
