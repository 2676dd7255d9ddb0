"""What every training rank writes into a checkpoint and reads back: model, optimizer, LR schedule
and RNG, via Megatron's distributed checkpointing (the directory itself, its `latest`, history and
pruning, is the driver's: `slimrl/checkpoint_dir.py`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slimrl.errors import SlimError
from slimrl.megatron_bridge.dist_ckpt import sharded_model_state, sync_save_strategy

if TYPE_CHECKING:
    from slimrl.trainer.actor import MegatronActor
    from slimrl.trainer.model import TrainState

CRITIC = "critic"
# Optimizer state layout: no gathers at save time; resharding over data-parallel ranks only.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


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

    model = sharded_model_state(train_state.model)
    optimizer = train_state.optimizer.sharded_state_dict(
        model, is_loading=is_loading, metadata=OPTIMIZER_METADATA
    )
    return {**model, "optimizer": optimizer}


def _save(train_state: TrainState, directory: Path, extra: dict[str, Any]) -> None:
    from megatron.core import dist_checkpointing

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
