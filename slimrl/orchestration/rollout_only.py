"""`slimrl rollout CONFIG`: generation only. Starts the fleet (embedded engines on CPU), runs
rollouts (and evals), and writes every sample to `runs/<name>/rollout_samples.jsonl`.

Dead engines are restarted in the background while rollouts run (`Fleet.watch`); SIGTERM stops
the run like Ctrl-C, and every process the run started is stopped on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.orchestration.entry import prepare_run_dir, setup_logging
from slimrl.orchestration.metrics import MetricsWriter

logger = logging.getLogger("slimrl")
HEAL_INTERVAL_S = 5.0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _import_from_working_directory() -> None:
    """Hooks named by dotted path (`examples.custom_reward.reward`) resolve from the working
    directory, as under `python -m`; the `slimrl` console script alone would not look there."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def write_samples(path: Path, rollout_id: int, groups: list[list[Any]], split: str) -> None:
    """Append one JSON object per sample: its `Sample` fields plus `rollout_id` and `split`."""
    with path.open("a") as handle:
        for group in groups:
            for sample in group:
                record = {"rollout_id": rollout_id, "split": split, **sample.to_dict()}
                handle.write(json.dumps(record) + "\n")


async def _rollouts(
    config: SlimConfig, fleet: Any, ctx: Any, samples_path: Path, writer: MetricsWriter, num_rollouts: int
) -> None:
    from slimrl.rollout.data_source import DataSource
    from slimrl.rollout.rollout import run_rollout

    source = DataSource(config)
    evals = {name: DataSource(config, path, shuffle=False) for name, path in config.eval.datasets.items()}
    watcher = asyncio.create_task(fleet.watch(HEAL_INTERVAL_S))
    try:
        for rollout_id in range(num_rollouts):
            ctx.rollout_id = rollout_id
            result = await run_rollout(ctx, source)
            write_samples(samples_path, rollout_id, result.groups, "train")
            metrics = {f"rollout/{k}": v for k, v in result.metrics.items()}
            metrics["rollout/failovers"] = float(ctx.client.failovers)
            metrics["rollout/engine_restarts"] = float(fleet.restarts)
            for name, eval_source in evals.items():
                evaluated = await run_rollout(ctx, eval_source, evaluation=True)
                write_samples(samples_path, rollout_id, evaluated.groups, f"eval/{name}")
                metrics.update({f"eval/{name}/{k}": v for k, v in evaluated.metrics.items()})
            writer.write(rollout_id + 1, metrics)
            logger.info(
                "rollout %d: reward %.3f, %d samples, %.1f tokens/s",
                rollout_id + 1,
                metrics["rollout/raw_reward"],
                int(metrics["rollout/samples"]),
                metrics["rollout/tokens_per_s"],
            )
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await ctx.client.close()


def run_rollout_only(config: SlimConfig, num_rollouts: int = 1) -> Path:
    from transformers import AutoTokenizer

    from slimrl.rollout.fleet import Fleet
    from slimrl.rollout.generate import RolloutContext
    from slimrl.rollout.rollout import check_hooks

    setup_logging(config.logging.level)
    _import_from_working_directory()
    check_hooks(config)  # a bad hook path fails now, not after the fleet has started
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops the fleet like Ctrl-C
    run_dir = prepare_run_dir(config)
    samples_path = run_dir / "rollout_samples.jsonl"
    samples_path.write_text("")
    fleet = Fleet(config, config.model.hf_checkpoint, run_dir / "logs")
    writer = MetricsWriter(run_dir, tensorboard=config.logging.tensorboard)
    try:
        client = fleet.start()
        ctx = RolloutContext(config, AutoTokenizer.from_pretrained(config.model.hf_checkpoint), client)
        asyncio.run(_rollouts(config, fleet, ctx, samples_path, writer, num_rollouts))
    finally:
        # A second SIGTERM must not interrupt the shutdown half-way and orphan servers.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        writer.close()
        fleet.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logger.info("wrote %s", samples_path)
    return run_dir
