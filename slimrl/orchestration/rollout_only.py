"""`slimrl rollout CONFIG`: generation only. Starts the fleet (embedded engines on CPU), runs
rollouts (and evals), and writes every sample to `runs/<name>/rollout_samples.jsonl`."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path

from slimrl.config.schema import SlimConfig
from slimrl.orchestration.entry import prepare_run_dir, setup_logging
from slimrl.orchestration.metrics import MetricsWriter

logger = logging.getLogger("slimrl")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def write_samples(path: Path, rollout_id: int, groups, split: str) -> None:
    with path.open("a") as handle:
        for group in groups:
            for sample in group:
                record = {"rollout_id": rollout_id, "split": split, **sample.to_dict()}
                handle.write(json.dumps(record) + "\n")


def run_rollout_only(config: SlimConfig, num_rollouts: int = 1) -> Path:
    from transformers import AutoTokenizer

    from slimrl.rollout.data_source import DataSource
    from slimrl.rollout.fleet import Fleet
    from slimrl.rollout.generate import RolloutContext
    from slimrl.rollout.rollout import run_rollout

    setup_logging(config.logging.level)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops the fleet like Ctrl-C
    run_dir = prepare_run_dir(config)
    samples_path = run_dir / "rollout_samples.jsonl"
    samples_path.write_text("")
    fleet = Fleet(config, config.model.hf_checkpoint, run_dir / "logs")
    writer = MetricsWriter(run_dir, tensorboard=config.logging.tensorboard)
    try:
        client = fleet.start()
        ctx = RolloutContext(config, AutoTokenizer.from_pretrained(config.model.hf_checkpoint), client)
        source = DataSource(config)
        evals = {name: DataSource(config, path, shuffle=False) for name, path in config.eval.datasets.items()}

        async def main() -> None:
            try:
                for rollout_id in range(num_rollouts):
                    ctx.rollout_id = rollout_id
                    result = await run_rollout(ctx, source)
                    write_samples(samples_path, rollout_id, result.groups, "train")
                    metrics = {f"rollout/{k}": v for k, v in result.metrics.items()}
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
                await client.close()

        asyncio.run(main())
    finally:
        writer.close()
        fleet.stop()
    return run_dir
