"""Trainer-identical logprobs for the embedded engine (`slimrl serve --true-on-policy`, CPU).

The engine decodes with its transformers model; when a request finishes, `MegatronScorer` scores
the whole sequence again with the trainer's own code: a Megatron-Core GPTModel (TP1/PP1/EP1) built
with the `BuildOptions` the trainer uses in true_on_policy mode (fp32, local spec,
`deterministic=True`), loaded from the same HF weights through the bridge, run on the unpadded
sequence `[1, S]` exactly as the trainer's true_on_policy micro-batches (`split_fixed(batch, 1)` +
`collate`), with `slimrl.trainer.logprobs.token_logprobs` at the sampling temperature. Same
weights, same shapes, same kernels, same thread count: the numbers are bit-identical to what the
trainer computes (tested), so `train/train_rollout_logprob_abs_diff` is exactly 0.

The Megatron twin follows every weight update: it is reloaded from the engine's live weights,
read under the checkpoint's HF names (`LiveHFWeights`), whichever transport delivered them.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from slimrl.compat import megatron_cpu
from slimrl.config.schema import SlimConfig
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.megatron_bridge.hf_io import HFCheckpointReader
from slimrl.megatron_bridge.loading import load_hf_into_megatron
from slimrl.parallel_layout import ParallelLayout
from slimrl.trainer.distributed import RankInfo, init_distributed
from slimrl.trainer.logprobs import token_logprobs
from slimrl.trainer.model import build_gpt_chunks, build_options
from slimrl.utils.net import free_port

log = logging.getLogger(__name__)


def _megatron_thread_context() -> contextlib.AbstractContextManager[Any]:
    """Megatron-Core on CPU needs `megatron_cpu`'s CUDA-to-CPU torch-function mode, which is
    per thread: `apply()` installed it on the thread that built the model, while scoring runs on
    the engine's scheduler thread."""

    if not megatron_cpu.needs_cpu_compat():
        return contextlib.nullcontext()
    return megatron_cpu._CudaToCpuMode()


@dataclass
class LiveHFWeights:
    """The engine's current weights under the checkpoint's HF names (views, no copy): the source the
    Megatron twin is reloaded from after an update. Fused MoE experts and tied embeddings are
    resolved by `WeightTargets`, so every transport and every naming of an update is covered."""

    targets: Any
    """`slimrl.rollout.embedded.weights.WeightTargets` of the engine's model."""
    names: list[str] = field(default_factory=list)

    def get(self, name: str) -> torch.Tensor:
        return self.targets.get(name).detach()


class MegatronScorer:
    """Rescorer for `EmbeddedEngine`: (tokens, response length, temperature) -> response-token logprobs."""

    wants_temperature = True
    """`EmbeddedEngine` passes each request's effective temperature (1.0 for greedy)."""

    def __init__(self, model_path: str, seed: int = 0) -> None:

        # The trainer's configuration in true_on_policy mode (defaults elsewhere): the same
        # `build_options` decides dtype, spec, dispatcher and deterministic mode. Built from the
        # schema, not loaded: these fixed settings need no gate (which sits above the rollout).
        self.config = SlimConfig()
        self.config.model.hf_checkpoint = model_path
        self.config.algorithm.true_on_policy = True
        self.config.cluster.device = "cpu"
        self.config.cluster.gpus_per_node = 1
        self.arch = read_model_arch(model_path, self.config.model.overrides)
        self.layout = ParallelLayout.resolve(self.config.parallel, 1, self.arch)
        info = RankInfo(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
        init_distributed(info, self.layout, seed)
        options = build_options(self.config, use_cuda=False)
        self.chunks = build_gpt_chunks(self.arch, self.layout, options, self.config.train.max_seq_len)
        self.names = list(HFCheckpointReader(model_path).names)
        load_hf_into_megatron(self.chunks, self.arch, self.layout, model_path)
        self.reloads = 0

    @property
    def model(self) -> Any:
        return self.chunks[0]

    def refresh(self, targets: Any) -> None:
        """Reload every Megatron tensor from the engine's live weights (after a weight update)."""

        with _megatron_thread_context():
            load_hf_into_megatron(self.chunks, self.arch, self.layout, LiveHFWeights(targets, self.names))
        self.reloads += 1

    def __call__(self, tokens: list[int], response_length: int, temperature: float = 1.0) -> list[float]:
        """log p(response token) under the current weights, computed exactly as the trainer does."""
        from slimrl.trainer.batch import TrainBatch, collate

        batch = TrainBatch(
            tokens=[list(tokens)], response_lengths=[response_length], loss_masks=[[1] * response_length]
        )
        mb = collate(batch)
        with torch.no_grad(), _megatron_thread_context():
            logits = self.model(mb.tokens_BS, mb.position_ids_BS, mb.attention_mask)
            logp, _ = token_logprobs(
                logits,
                mb.labels_BS,
                true_vocab=self.arch.vocab_size,
                temperature=temperature,
                chunk_tokens=self.config.train.logprob_chunk_tokens,
            )
        return mb.per_sequence(logp)[0]
