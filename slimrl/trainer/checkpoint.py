"""Training checkpoints: model, optimizer, LR schedule and RNG of every rank, via Megatron's
distributed checkpointing, written atomically.

Layout under `checkpoint.save_dir`:

    iter_0000004/      a complete checkpoint (torch_dist files + driver_state.json + rng_rank*.pt)
        critic/        PPO only: the value model's own torch_dist checkpoint (model, optimizer,
                       schedule); its keys are the policy's, so it cannot share the directory
    latest             text file naming the newest complete checkpoint
    history.json       the checkpoints this directory's runs published, in completion order

All ranks write into a temporary sibling directory; the driver adds its own state (rollout id,
data position, buffer) and only then renames it into place and rewrites `latest` (both atomic).
A kill at any point leaves the previous checkpoint as `latest`.

Pruning keeps the `keep_last` most recently *completed* checkpoints named in `history.json`
(never by step number: a run restarted at an earlier step would otherwise delete what it just
wrote), so it never removes the newest one or one no run here published. A pruned checkpoint is
first renamed aside, so a kill mid-delete never leaves a half-deleted directory that looks whole.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slimrl.errors import ConfigError
from slimrl.utils.fs import atomic_write_text, replace_directory

if TYPE_CHECKING:
    from slimrl.config.schema import SlimConfig
    from slimrl.trainer.actor import MegatronActor
    from slimrl.trainer.model import TrainState

LATEST = "latest"
HISTORY = "history.json"
SUPERSEDED = "superseded.json"
DRIVER_STATE = "driver_state.json"
CRITIC = "critic"
# Optimizer state layout: no gathers at save time; resharding over data-parallel ranks only.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
_ITER = re.compile(r"^iter_(\d{7})$")


def iteration_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    path = Path(root) / marker.read_text().strip()
    return path if (path / DRIVER_STATE).is_file() else None


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _train_state(train_state: TrainState, is_loading: bool) -> dict[str, Any]:
    from slimrl.megatron_bridge.dist_ckpt import sharded_model_state

    model = sharded_model_state(train_state.model)
    optimizer = train_state.optimizer.sharded_state_dict(
        model, is_loading=is_loading, metadata=OPTIMIZER_METADATA
    )
    return {**model, "optimizer": optimizer}


def _save(train_state: TrainState, directory: Path, extra: dict[str, Any]) -> None:
    from megatron.core import dist_checkpointing

    from slimrl.megatron_bridge.dist_ckpt import sync_save_strategy

    state = _train_state(train_state, is_loading=False)
    state["scheduler"] = train_state.scheduler.state_dict()
    state.update(extra)
    dist_checkpointing.save(state, str(directory), sharded_strategy=sync_save_strategy())


def save_train_state(actor: MegatronActor, directory: Path) -> None:
    """All ranks: write this rank's share of the training state (and the critic's) into `directory`."""
    import torch.distributed as dist

    assert actor.state is not None
    _save(actor.state, directory, {"steps_done": actor.steps_done})
    if actor.critic is not None:
        (directory / CRITIC).mkdir(exist_ok=True)  # every rank: the directory may not be shared
        dist.barrier()
        _save(actor.critic.state, directory / CRITIC, {})
    torch.save(_rng_state(), directory / f"rng_rank{dist.get_rank()}.pt")
    dist.barrier()


def _materialise_optimizer_state(optimizer: Any) -> None:
    """A fresh optimizer has no Adam state yet; the sharded load needs tensors to load into.
    (Megatron's dummy step may touch the weights; they are loaded right after.)"""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
            inner._init_optimizer_states_with_dummy_values()
        else:
            inner.init_state_fn(inner.optimizer, getattr(inner, "config", None))


def _restore_adam_step(optimizer: Any, updates: int) -> None:
    """megatron-core 0.16.1 restores Adam's step counter from `param_groups`, which the
    dp_reshardable layout does not carry, leaving the dummy value (1): bias correction would then
    be wrong after a resume. The LR scheduler counts exactly the successful updates."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in getattr(getattr(inner, "optimizer", None), "state", {}).values():
            if "step" in state:
                state["step"] = torch.tensor(float(updates), dtype=state["step"].dtype)


def _load(train_state: TrainState, directory: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Restore model, optimizer and schedule of `train_state`; returns the `extra` plain values."""
    from megatron.core import dist_checkpointing

    _materialise_optimizer_state(train_state.optimizer)
    state = _train_state(train_state, is_loading=True)
    loaded = dist_checkpointing.load(state, str(directory))
    modules = [getattr(c, "module", c) for c in train_state.model]
    for index, module in enumerate(modules):
        module.load_state_dict(loaded["model" if len(modules) == 1 else f"model{index}"], strict=True)
    with torch.no_grad():  # fp32 runs step the parameters themselves: they are leaves requiring grad
        train_state.optimizer.load_state_dict(loaded["optimizer"])
    train_state.scheduler.load_state_dict(loaded["scheduler"])
    _restore_adam_step(train_state.optimizer, train_state.scheduler.num_steps)
    return {key: loaded[key] for key in extra}


def load_train_state(actor: MegatronActor, directory: Path) -> None:
    """All ranks: restore model, optimizer, schedule, the critic's (and RNG when the world size matches)."""
    import torch.distributed as dist

    from slimrl.errors import SlimError

    assert actor.state is not None
    if actor.critic is not None and not (directory / CRITIC).is_dir():
        raise SlimError(
            f"{directory}: no {CRITIC}/ in this checkpoint (saved without a critic); to start PPO from "
            f"its weights set model.load={directory} and checkpoint.resume=false"
        )
    actor.steps_done = int(_load(actor.state, directory, ("steps_done",))["steps_done"])
    if actor.critic is not None:
        _load(actor.critic.state, directory / CRITIC)
    rng = directory / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))


def checkpoint_root(config: SlimConfig, run_dir: Path) -> Path:
    return Path(config.checkpoint.save_dir) if config.checkpoint.save_dir else Path(run_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _ITER.match(p.name) and (p / DRIVER_STATE).is_file())


def prepare_start(root: Path, resume: bool, overwrite: bool) -> None:
    """Before anything starts: a run that will not resume may not silently reuse a directory that
    holds an earlier run's checkpoints. With `overwrite` they are kept until this run's first
    checkpoint is complete, and only then removed (`publish`)."""
    existing = complete_checkpoints(root)
    if resume or not existing:
        return
    if not overwrite:
        raise ConfigError(
            f"checkpoint.resume=false: {root} holds checkpoints of an earlier run ({', '.join(existing)}); "
            f"set checkpoint.resume=true to continue it, checkpoint.overwrite=true to replace it, "
            f"or choose another run.name / checkpoint.save_dir"
        )
    atomic_write_text(Path(root) / SUPERSEDED, json.dumps(existing))
    atomic_write_text(Path(root) / HISTORY, json.dumps([]))


def new_tmp_dir(root: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step` (leftovers of killed saves go)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".iter_*.tmp"):  # one save at a time per directory: any other is dead
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".iter_{step:07d}.tmp"
    tmp.mkdir()
    return tmp


def publish(root: Path, tmp: Path, step: int, driver_state: dict[str, Any], keep_last: int) -> Path:
    """Driver: add its state, rename into place, point `latest` at it, prune old ones."""
    if keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={keep_last}: must be >= 1 (0 would delete every checkpoint)")
    atomic_write_text(tmp / DRIVER_STATE, json.dumps(driver_state))
    final = iteration_dir(root, step)
    replace_directory(tmp, final, overwrite=True)
    history = [n for n in _read_json(root / HISTORY, []) if n != final.name and _complete(root, n)]
    history.append(final.name)
    atomic_write_text(root / HISTORY, json.dumps(history))
    atomic_write_text(root / LATEST, final.name + "\n")
    doomed = history[:-keep_last] + [n for n in _read_json(root / SUPERSEDED, []) if n not in history]
    for name in doomed:
        _remove(root / name)
    atomic_write_text(root / HISTORY, json.dumps(history[-keep_last:]))
    (root / SUPERSEDED).unlink(missing_ok=True)
    for stale in root.glob(".iter_*.deleting"):  # what a kill mid-prune left
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _complete(root: Path, name: str) -> bool:
    return bool(_ITER.match(name)) and (Path(root) / name / DRIVER_STATE).is_file()


def _remove(path: Path) -> None:
    """Rename aside, then delete: a kill mid-delete leaves `.iter_*.deleting`, never a checkpoint
    that still has its driver state but lost some shards."""
    if not path.exists():
        return
    aside = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def read_driver_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / DRIVER_STATE).read_text())
