"""`finalize`: every value the run derives from the config, derived once, in one place.

A loaded config keeps what the user wrote (`auto`, null for "derive it"); `finalize` returns a copy
in which each such value is replaced by what the run uses: the device and dtype, the parallel layout
(`dp`, `etp`, `sequence_parallel`), the weight-sync transport, batch sizes, the clip range, the
loss normaliser, the LR decay horizon, the offload switch and the checkpoint directory. `slimrl train`
and `slimrl rollout` run on it and write it to `<run dir>/resolved.yaml` (beside `config.yaml`, the
config as given); loading that file gives the same config again.
"""

from __future__ import annotations

import copy
from pathlib import Path

from slimrl.config.schema import SlimConfig
from slimrl.devices.device import resolve_device
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.parallel_layout import ParallelLayout

DEFAULT_SFT_BATCH = 32
"""Samples per SFT optimizer step when `train.global_batch_size` is null."""


def weight_transport(config: SlimConfig) -> str:
    """The transport `rollout.weight_sync` resolves to; the loop and `--dry-run` both ask here.

    `auto` never picks one the layout breaks (`slimrl/devices/rules.py`): colocated, `tensor`, on
    any number of nodes: every engine rank maps references (CUDA IPC by GPU UUID, shared memory on
    CPU) from the trainer rank on its own GPU; `distributed` would put trainer rank 0 and the
    colocated engine on its GPU in one NCCL group, which NCCL refuses. Disaggregated,
    `distributed` (NCCL among distinct GPUs). `disk` needs a directory every node shares, which
    cannot be checked from here, so it is never chosen.
    """
    choice = config.rollout.weight_sync
    if choice != "auto":
        return choice
    return "tensor" if config.cluster.colocate else "distributed"


def sft_batch_size(config: SlimConfig) -> int:
    """Samples per SFT optimizer step: `train.global_batch_size`, by default DEFAULT_SFT_BATCH."""
    return config.train.global_batch_size or DEFAULT_SFT_BATCH


def rl_batch_size(config: SlimConfig) -> int:
    """Samples per RL optimizer step: the rollout's samples over `train.steps_per_rollout`."""
    rollout = config.rollout
    return rollout.rollout_batch_size * rollout.n_samples_per_prompt // config.train.steps_per_rollout


def finalize(config: SlimConfig) -> SlimConfig:
    """A copy of a checked config with every derived value filled in (idempotent)."""

    out = copy.deepcopy(config)
    device = resolve_device(config)
    policy = config.algorithm.loss == "policy"
    out.cluster.device = device
    if config.model.dtype == "auto":
        out.model.dtype = "bf16" if device == "cuda" else "fp32"

    arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
    layout = ParallelLayout.resolve(config.parallel, config.train_world_size(), arch)
    out.parallel.dp, out.parallel.etp = layout.dp, layout.etp
    out.parallel.sequence_parallel = layout.sequence_parallel

    rollout, algo, train = out.rollout, out.algorithm, out.train
    rollout.weight_sync = weight_transport(config)
    if rollout.over_sampling_batch_size is None:
        rollout.over_sampling_batch_size = rollout.rollout_batch_size
    if algo.eps_clip_high is None:
        algo.eps_clip_high = algo.eps_clip
    if algo.loss_norm_tokens is None and algo.loss_reduction == "seq_mean_token_sum_norm":
        algo.loss_norm_tokens = rollout.sampling.max_new_tokens

    train.global_batch_size = rl_batch_size(config) if policy else sft_batch_size(config)
    optimizer_steps = train.num_steps * (train.steps_per_rollout if policy else 1)
    if train.lr_schedule.decay_steps is None:
        train.lr_schedule.decay_steps = optimizer_steps
    if policy and train.offload is None:  # the trainer leaves the devices to the engines during rollout
        train.offload = config.cluster.colocate and device == "cuda"

    if out.checkpoint.save_dir is None:
        out.checkpoint.save_dir = str(Path(config.run.runs_dir) / config.run.name / "checkpoints")
    return out
