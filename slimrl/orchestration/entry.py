"""`slimrl train`: run directory, Ray, the trainer group, then the SFT or RL loop."""

from __future__ import annotations

import logging
import secrets
import signal
from pathlib import Path

from slimrl import checkpoint_dir
from slimrl.config.schema import SlimConfig
from slimrl.orchestration.placement import TRAIN_SHARE_COLOCATED, create_device_slots, run_ledger, start_ray
from slimrl.preflight.checks import check_run_inputs
from slimrl.preflight.finalize import finalize
from slimrl.preflight.loader import save_config

logger = logging.getLogger("slimrl")


def prepare_run_dir(config: SlimConfig) -> tuple[Path, SlimConfig]:
    """Create the run directory; write `config.yaml` (the config as given) and `resolved.yaml`
    (every derived value filled in: `finalize`), neither with its secrets. Returns the directory
    and the resolved config, which the run uses from here on; it then gets the engines' admin key
    (drawn after saving, so it never lands on disk; a resumed run draws a new one, as its engines
    are new)."""
    run_dir = Path(config.run.runs_dir) / config.run.name
    resolved = finalize(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    save_config(resolved, run_dir / "resolved.yaml")
    if resolved.rollout.admin_api_key is None:
        # Hex, not urlsafe: a key starting with "-" (1 draw in 64) reads as an option to the
        # engines' argparse (`--admin-api-key -x...`), and the run fails to start.
        resolved.rollout.admin_api_key = secrets.token_hex(24)
    return run_dir, resolved


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_training(config: SlimConfig) -> Path:
    """Run the whole job and return its run directory."""
    import ray

    from slimrl.orchestration.trainer_group import TrainerGroup

    setup_logging(config.logging.level)
    check_run_inputs(config)  # everything else was checked when the config loaded
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: Ray and servers stop
    run_path = Path(config.run.runs_dir) / config.run.name
    root = checkpoint_dir.checkpoint_root(config, run_path)
    checkpoint_dir.prepare_start(root, config.checkpoint.resume, config.checkpoint.overwrite)
    run_dir, config = prepare_run_dir(config)
    device = config.cluster.device  # finalized: cpu or cuda
    world = config.train_world_size()
    total_slots = config.cluster.num_nodes * config.cluster.gpus_per_node
    logger.info("run dir %s; %d training ranks on %s", run_dir, world, device)
    start_ray(config, device, total_slots)
    # ray.init installs Ray's own SIGTERM handler (a C++ stack dump, then death by the signal, with
    # engines and checkpoints left to chance): ours again, so SIGTERM unwinds like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        slots = create_device_slots(total_slots, use_gpu=device == "cuda")
        ledger = run_ledger(config, slots, device)  # the GPU's rules on the real placement
        trainers = TrainerGroup(config, slots, world, share=TRAIN_SHARE_COLOCATED, ledger=ledger)
        if config.algorithm.loss == "sft":
            from slimrl.orchestration.sft_loop import run_sft

            run_sft(config, run_dir, trainers)
        else:
            from slimrl.orchestration.rl_loop import run_rl

            run_rl(config, run_dir, slots, trainers)
    finally:
        if not config.ray.address:
            ray.shutdown()
    return run_dir
