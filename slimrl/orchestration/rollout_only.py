"""`slimrl rollout CONFIG`: generation only. Starts the fleet (embedded engines on CPU), runs
rollouts (and evals), and writes every sample to `runs/<name>/rollout_samples.jsonl`.

Dead engines are restarted in the background while rollouts run (`Fleet.watch`); SIGTERM stops
the run like Ctrl-C, and every process the run started is stopped on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.data.hf_tokenizer import load_tokenizer
from slimrl.orchestration.entry import prepare_run_dir, setup_logging
from slimrl.orchestration.metrics import MetricsWriter, log_due
from slimrl.orchestration.sample_log import start_samples, write_rollout, write_samples
from slimrl.preflight.checks import check_run_inputs
from slimrl.rollout.data_source import DataSource

logger = logging.getLogger("slimrl")
HEAL_INTERVAL_S = 5.0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


async def _rollouts(
    config: SlimConfig,
    fleet: Any,
    ctx: Any,
    samples_path: Path | None,
    writer: MetricsWriter,
    num_rollouts: int,
) -> None:

    source = DataSource(config)
    evals = {name: DataSource(config, path, shuffle=False) for name, path in config.eval.datasets.items()}
    watcher = asyncio.create_task(fleet.watch(HEAL_INTERVAL_S))
    try:
        for rollout_id in range(num_rollouts):
            ctx.rollout_id = rollout_id
            result = await healed_rollout(ctx, source, fleet)
            if samples_path is not None:
                write_rollout(samples_path, rollout_id, result.groups, "train", result.unfinished)
            metrics = {f"rollout/{k}": v for k, v in result.metrics.items()}
            metrics["rollout/failovers"] = float(ctx.client.failovers)
            metrics["rollout/engine_restarts"] = float(fleet.restarts)
            for name, eval_source in evals.items():
                evaluated = await healed_rollout(ctx, eval_source, fleet, evaluation=True)
                if samples_path is not None:
                    write_samples(samples_path, rollout_id, evaluated.groups, f"eval/{name}")
                metrics.update({f"eval/{name}/{k}": v for k, v in evaluated.metrics.items()})
            writer.write(rollout_id + 1, metrics)
            if log_due(rollout_id + 1, num_rollouts, config.logging.log_interval):
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
        from slimrl.rollout.agent.runner import close_agents

        await close_agents(ctx)  # agent runs parked by the last rollout (partial rollout)
        await ctx.client.close()


async def healed_rollout(ctx: Any, source: Any, fleet: Any, evaluation: bool = False) -> Any:
    """A rollout that stopped because every engine was down runs again once the watcher has
    restarted them (the groups it had drawn are not retried: generation only, nothing to resume)."""
    from slimrl.rollout.client import FleetDown
    from slimrl.rollout.rollout import run_rollout

    while True:
        try:
            return await run_rollout(ctx, source, evaluation=evaluation)
        except FleetDown as exc:
            logger.warning("%s: rollout %d runs again once the fleet is healed", exc, ctx.rollout_id)
            deadline = time.monotonic() + fleet.config.rollout.sglang.server_timeout_s + HEAL_INTERVAL_S
            while not ctx.client.live_engines():
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


def run_rollout_only(config: SlimConfig, num_rollouts: int = 1) -> Path:
    from slimrl.rollout.fleet import Fleet
    from slimrl.rollout.generate import RolloutContext

    setup_logging(config.logging.level)
    check_run_inputs(config)  # hooks, data and the rest were checked when the config loaded
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops the fleet like Ctrl-C
    run_dir, config = prepare_run_dir(config)
    samples_path = start_samples(run_dir) if config.rollout.save_samples else None
    fleet = Fleet(config, config.model.hf_checkpoint, run_dir / "logs")
    writer = MetricsWriter(run_dir, tensorboard=config.logging.tensorboard)
    try:
        client = fleet.start()
        tokenizer = load_tokenizer(config.model.hf_checkpoint, config.model.trust_remote_code)
        ctx = RolloutContext(config, tokenizer, client)
        asyncio.run(_rollouts(config, fleet, ctx, samples_path, writer, num_rollouts))
    finally:
        # A second SIGTERM must not interrupt the shutdown half-way and orphan servers.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        writer.close()
        fleet.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if samples_path is not None:
        logger.info("wrote %s", samples_path)
    return run_dir
