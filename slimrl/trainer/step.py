"""`StepRunner`: how one rank runs a pass of a model over its share of a batch.

Every pass of every model goes through here: the policy's and the reference's logprobs, the
critic's values, the policy, critic and SFT updates. It owns what they share and what must be
the same on every rank: cutting the batch into micro-batches (the same count on every DP rank),
the OOM retry (every rank agrees, then re-splits), Megatron's pipeline schedule (with routing
replay for the policy), the numerics guard around the optimizer step, and the reductions over
data-parallel ranks. The algorithms (`rl`, `ppo`, `critic`) say only what a micro-batch's output
means: a loss, or the per-token values to keep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError
from slimrl.megatron_bridge.megatron_config import BuildOptions, uniform_shapes
from slimrl.parallel_layout import ParallelLayout
from slimrl.trainer.batch import (
    MicroBatch,
    TrainBatch,
    collate,
    collate_packed,
    pad_micro_batch_count,
    split_by_tokens,
    split_fixed,
)
from slimrl.trainer.model import TrainState
from slimrl.trainer.numerics import NumericsGuard, grad_buffers
from slimrl.utils import faults

if TYPE_CHECKING:
    from slimrl.trainer.router_margins import RouterMargins
    from slimrl.trainer.routing_replay import RoutingReplay

logger = logging.getLogger(__name__)

LossFor = Callable[[int], Callable[[MicroBatch, Any], Any]]
"""`loss_for(n)`: the loss of an attempt cut into n micro-batches (its scale depends on the count,
which an OOM re-split changes); the loss maps (micro-batch, output) to (loss, report)."""
Keep = Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]]
"""What a forward-only pass keeps of a micro-batch's output: named per-token tensors [B, S]."""


@dataclass
class StepResult:
    reports: list[dict]
    """One report per micro-batch (last pipeline stage; empty dicts elsewhere)."""
    applied: bool
    """False when the numerics guard skipped the step (gradients not finite on some rank)."""
    grad_norm: float


class StepRunner:
    def __init__(
        self,
        config: SlimConfig,
        layout: ParallelLayout,
        options: BuildOptions,
        policy: TrainState,
        routing: RoutingReplay | None,
        rank: int,
    ) -> None:
        self.config = config
        self.layout = layout
        self.options = options
        self.policy = policy
        self.routing = routing
        self.margins: RouterMargins | None = None
        """Set while the update check's probe runs: the policy's routers record their margins."""
        self.rank = rank
        self.oom_retries = 0
        self.numerics: dict[int, NumericsGuard] = {}
        """Per trained model (policy, critic): its non-finite gradient steps."""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients, every model."""
        return sum(guard.skipped for guard in self.numerics.values())

    # ---------------------------------------------------------------- micro-batches
    def packing(self) -> bool:
        """Pack sequences into one row (block-diagonal mask) on the local attention path; TE's fused
        attention needs THD packed-sequence params instead, so GPU runs pad minimally."""
        return not self.options.use_te and not uniform_shapes(self.layout, self.options)

    def micro_batches(self, batch: TrainBatch, max_tokens: int | None = None) -> list[MicroBatch]:
        """Cut this rank's batch into micro-batches; every DP rank ends up with the same count (a
        multiple of pp under VPP, padded with loss-free micro-batches)."""
        train = self.config.train
        budget = max_tokens or train.max_tokens_per_gpu
        pack = False
        if self.config.algorithm.true_on_policy:
            # One sequence per micro-batch, unpadded: the exact shapes the engine rescored with.
            parts = split_fixed(batch, 1)
        elif budget:
            pack = self.packing()
            parts = split_by_tokens(batch, budget, packed=pack)
        else:
            parts = split_fixed(batch, train.micro_batch_size)
        count = self.max_over_dp(len(parts))
        if self.layout.vpp:  # the interleaved schedule runs micro-batches in groups of pp
            count = -(-count // self.layout.pp) * self.layout.pp
        parts = pad_micro_batch_count(parts, count)
        # Sequence parallelism splits the sequence dimension over TP ranks.
        multiple = self.layout.tp if self.layout.sequence_parallel else 1
        if pack:
            return [collate_packed(part, pad_to_multiple=multiple) for part in parts]
        uniform = uniform_shapes(self.layout, self.options)  # the same [rows, length] for every one
        same_length = max(len(t) for t in batch.tokens) if uniform else 0
        same_rows = max(len(part) for part in parts) if uniform else 0
        return [
            collate(part, pad_to_multiple=multiple, min_length=same_length, min_rows=same_rows)
            for part in parts
        ]

    def with_oom_retry(
        self, run: Callable[[list[MicroBatch]], Any], batch: TrainBatch, model: list[Any]
    ) -> Any:
        """`run(micro_batches)` with OOM recovery: every rank agrees on failure (an all-reduced
        flag), `model`'s gradients are dropped, and the pass is redone with micro-batches half as
        big, up to `train.oom_max_splits` times. Exact when the OOM strikes outside a collective
        (the usual site in RL: the logits); a step is never silently skipped."""
        import torch.distributed as dist

        budget = self.config.train.max_tokens_per_gpu
        for attempt in range(self.config.train.oom_max_splits + 1):
            micro_batches = self.micro_batches(batch, max_tokens=budget)
            failed = torch.zeros(1)
            reason = ""
            try:
                result = run(micro_batches)
            except torch.OutOfMemoryError as exc:
                failed += 1
                reason = str(exc).splitlines()[0]
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if not failed.item():
                return result
            largest = max(mb.num_tokens for mb in micro_batches)
            budget = max(largest // 2, max(len(t) for t in batch.tokens))
            self.oom_retries += 1
            logger.warning(
                "out of memory (%s, attempt %d); retrying with at most %d tokens per micro-batch",
                reason or "on another rank",
                attempt + 1,
                budget,
            )
            for chunk in model:
                chunk.zero_grad_buffer()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        raise SlimError(
            f"out of memory even after {self.config.train.oom_max_splits} splits "
            f"(train.oom_max_splits); lower train.max_tokens_per_gpu or check `slimrl plan`"
        )

    # ---------------------------------------------------------------- the schedule
    def schedule(
        self,
        micro_batches: list[MicroBatch],
        loss_fn,
        forward_only: bool,
        with_labels: bool,
        model: list[Any],
    ) -> list[dict]:
        """Megatron's pipeline schedule over `model`'s chunks."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        inject = self.config.train.inject_oom_above_tokens
        # The critic routes on its own; a disabled replay lets the policy's routers choose too.
        routing = self.routing
        replay = routing if model is self.policy.model and routing is not None and routing.enabled else None
        margins = self.margins if model is self.policy.model else None

        def forward_step(data_iterator, chunk):
            mb = next(data_iterator)
            if inject is not None and mb.num_tokens > inject:
                raise torch.OutOfMemoryError(f"injected: micro-batch of {mb.num_tokens} tokens")
            if replay is not None:
                replay.set_targets(chunk, mb)
            if margins is not None:
                margins.set_batch(chunk, mb)
            labels = mb.labels_BS if with_labels else None
            output = chunk(mb.tokens_BS, mb.position_ids_BS, mb.attention_mask, labels=labels)
            return output, partial(loss_fn, mb)

        iterators = [iter(micro_batches) for _ in model]
        longest = max(mb.tokens_BS.shape[1] for mb in micro_batches)
        if replay is not None:
            replay.start(recompute_in_backward=not forward_only and self.options.recompute == "full")
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=model,
                num_microbatches=len(micro_batches),
                seq_length=longest,
                micro_batch_size=max(mb.tokens_BS.shape[0] for mb in micro_batches),
                forward_only=forward_only,
            )
        finally:
            if replay is not None:
                replay.finish()

    def forward_only(
        self, batch: TrainBatch, keep: Keep, state: TrainState | None = None
    ) -> dict[str, dict[int, list[float]]]:
        """A forward-only pass of `state`'s model (default the policy) over `batch`: for each name
        `keep` returns, each sequence's values at its response tokens, by sample id (last pipeline
        stage; empty elsewhere)."""
        model = (state or self.policy).model
        kept: dict[str, dict[int, list[float]]] = {}

        def capture(mb: MicroBatch, output: torch.Tensor):
            for name, values_BS in keep(mb, output).items():
                kept.setdefault(name, {}).update(mb.per_sequence(values_BS))
            return output.sum() * 0.0, {}

        def run(micro_batches: list[MicroBatch]) -> None:
            kept.clear()  # a retried attempt starts over
            self.schedule(micro_batches, capture, forward_only=True, with_labels=False, model=model)

        with torch.no_grad():
            self.with_oom_retry(run, batch, model)
        for per_sample in kept.values():
            per_sample.pop(-1, None)  # the padding micro-batches' rows
        return kept

    def optimizer_step(
        self, batch: TrainBatch, loss_for: LossFor, state: TrainState | None = None, with_labels: bool = True
    ) -> StepResult:
        """Zero the gradients, forward/backward over `batch` (with OOM recovery), one optimizer and
        scheduler step, for the policy or another model's `state` (the critic)."""
        state = state or self.policy

        def run(micro_batches: list[MicroBatch]) -> list[dict]:
            loss_fn = loss_for(len(micro_batches))
            return self.schedule(
                micro_batches, loss_fn, forward_only=False, with_labels=with_labels, model=state.model
            )

        for chunk in state.model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        reports = self.with_oom_retry(run, batch, state.model)
        guard = self.numerics.setdefault(id(state), NumericsGuard(self.config.train.max_nonfinite_steps))
        guard.steps += 1
        faults.nonfinite_grad(list(grad_buffers(state.model)), guard.steps, self.rank)  # a test's
        if not guard.gradients_finite(state.model):  # skipped on every rank: nothing applied
            for chunk in state.model:
                chunk.zero_grad_buffer()
            state.optimizer.zero_grad()
            return StepResult(reports, False, float("nan"))
        ok, grad_norm, _ = state.optimizer.step()
        if ok:
            state.scheduler.step(increment=1)
        return StepResult(reports, ok, float(grad_norm) if grad_norm is not None else float("nan"))

    def megatron_scaled(self, loss_fn: Callable[..., Any]) -> LossFor:
        """`loss_fn(mb, output, scale)` as `optimizer_step` wants it. Each micro-batch's loss is
        already divided by the step's global normaliser; Megatron's schedule divides by the
        micro-batch count and DDP averages over data-parallel (and context-parallel) ranks, which
        the scale undoes."""

        def loss_for(num_micro_batches: int) -> Callable[..., Any]:
            scale = num_micro_batches * self.layout.dp * self.layout.cp
            return lambda mb, output: loss_fn(mb, output, scale)

        return loss_for

    # ---------------------------------------------------------------- reductions
    def max_over_dp(self, value: int) -> int:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(
            tensor, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group(with_context_parallel=True)
        )
        return int(tensor.item())

    def sum_over_dp(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the data-parallel (and context-parallel) ranks, in float64."""
        if not values:
            return {}
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        keys = sorted(values)
        packed = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(
            packed, group=mpu.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
        )
        return dict(zip(keys, packed.tolist(), strict=True))

    def summed_reports(self, reports: list[dict]) -> dict[str, float]:
        """Every report key summed over the micro-batches, then over data-parallel ranks (the last
        pipeline stage's ranks call it: they hold the reports)."""
        keys = sorted({k for r in reports for k in r})
        return self.sum_over_dp({k: float(sum(float(r.get(k, 0.0)) for r in reports)) for k in keys})


def token_means(summed: dict[str, float], prefix: str) -> dict[str, float]:
    """Summed reports as metrics: a `<key>_sum` over loss tokens becomes the token mean `<key>`,
    other keys stay sums; `tokens` is the divisor (taken out)."""
    summed = dict(summed)
    tokens = max(summed.pop("tokens", 0.0), 1.0)
    return {
        f"{prefix}{key.removesuffix('_sum')}": value / tokens if key.endswith("_sum") else value
        for key, value in summed.items()
    }
