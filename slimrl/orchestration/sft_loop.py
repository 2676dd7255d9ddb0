"""Supervised fine-tuning: the same Megatron actors and batching as RL, samples from a data set."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from slimrl.checkpoint_dir import checkpoint_root, latest_checkpoint, read_driver_state
from slimrl.config.schema import SlimConfig
from slimrl.data.hf_tokenizer import load_tokenizer
from slimrl.data.prompts import EpochSampler, drop_long_prompts, load_prompts
from slimrl.data.sft import sft_sample
from slimrl.orchestration.metrics import MetricsWriter, log_due
from slimrl.orchestration.train_data import split_for_dp
from slimrl.orchestration.trainer_group import TrainerGroup
from slimrl.preflight.finalize import sft_batch_size
from slimrl.utils.hang import Hung, with_stacks

logger = logging.getLogger(__name__)


def should_save(config: SlimConfig, step: int) -> bool:
    interval = config.checkpoint.save_interval
    return step == config.train.num_steps or (interval is not None and step % interval == 0)


def resume(config: SlimConfig, root: Path, trainers: TrainerGroup, sampler: EpochSampler) -> int:
    """Load the latest complete checkpoint (if resuming); returns the step it was taken at."""

    latest = latest_checkpoint(root) if config.checkpoint.resume else None
    if latest is None:
        return 0
    trainers.load_checkpoint(latest)
    state = read_driver_state(latest)
    sampler.load_state_dict(state["sampler"])
    logger.info("resumed from %s (step %d)", latest, state["step"])
    return int(state["step"])


def run_sft(config: SlimConfig, run_dir: Path, trainers: TrainerGroup) -> None:

    assert config.data.prompt_data is not None  # check_run_inputs: before anything started
    tokenizer = load_tokenizer(config.model.hf_checkpoint, config.model.trust_remote_code)
    data = config.data
    records = load_prompts(
        data.prompt_data, data.input_key, data.label_key, data.metadata_key, data.tools_key
    )
    records = drop_long_prompts(
        records, tokenizer, data.max_prompt_tokens, data.apply_chat_template, data.prompt_data
    )
    sampler = EpochSampler(len(records), config.run.seed, config.data.shuffle)
    batch_size = sft_batch_size(config)  # divisible by the data-parallel size: checked at load
    steps = config.train.num_steps

    summaries = trainers.setup(total_steps=steps)
    total_params = sum(s["local_params"] for s in summaries)
    logger.info(
        "%d ranks, %d data-parallel; %d parameters held in total",
        len(summaries),
        trainers.dp_size,
        total_params,
    )

    ckpt_root = checkpoint_root(config, run_dir)
    start_step = resume(config, ckpt_root, trainers, sampler)
    writer = MetricsWriter(run_dir, tensorboard=config.logging.tensorboard, start_step=start_step)
    try:
        for step in range(start_step, steps):
            start = time.perf_counter()
            indices = sampler.take(batch_size)
            samples = [sft_sample(tokenizer, records[i], config.data.apply_chat_template, i) for i in indices]
            result = trainers.train_step(split_for_dp(samples, trainers.dp_size))
            metrics = {
                "loss": result["loss"],
                "grad_norm": result["grad_norm"],
                "lr": result["lr"],
                "tokens": int(sum(len(s.tokens) for s in samples)),
                "seconds": time.perf_counter() - start,
            }
            writer.write(step + 1, metrics)
            if log_due(step + 1, steps, config.logging.log_interval):
                logger.info(
                    "step %d/%d | loss %.4f | grad_norm %.3f | lr %.2e | %.2fs",
                    step + 1, steps, metrics["loss"], metrics["grad_norm"], metrics["lr"], metrics["seconds"],
                )  # fmt: skip
            if should_save(config, step + 1):
                state = {"step": step + 1, "sampler": sampler.state_dict()}
                trainers.save_checkpoint(ckpt_root, step + 1, state, config.checkpoint.keep_last)
    except Hung as exc:
        raise with_stacks(exc, run_dir, {"driver": os.getpid(), **trainers.pid_of}) from None
    finally:
        writer.close()
