"""The colocated memory handoff against engines as strict as SGLang's memory saver on a GPU:
released memory loses its contents, a resume of what was never released kills the scheduler
(`KeyError` in `resume_memory_occupation`), and weights may be pushed only while held."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from slimrl.errors import SlimError
from slimrl.orchestration.colocation import KV_CACHE, WEIGHTS, MemoryHandoff


class StrictEngines:
    """Engines that hold tags and lose the weights' contents on release, as on a GPU."""

    def __init__(self, count: int) -> None:
        self.held = [{WEIGHTS, KV_CACHE} for _ in range(count)]
        self.weights_valid = [True] * count
        self.calls: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = []

    def control(
        self, endpoint: str, payload: dict[str, Any] | None = None, only: Sequence[int] | None = None
    ):
        targets = list(range(len(self.held))) if only is None else list(only)
        tags = set((payload or {}).get("tags") or [WEIGHTS, KV_CACHE])
        self.calls.append((endpoint, tuple(sorted(tags)), tuple(targets)))
        for i in targets:
            if endpoint == "release_memory_occupation":
                self.held[i] -= tags
                if WEIGHTS in tags:
                    self.weights_valid[i] = False  # no --enable-weights-cpu-backup
            elif endpoint == "resume_memory_occupation":
                if not tags <= {WEIGHTS, KV_CACHE} - self.held[i]:
                    raise KeyError(f"engine {i}: resume of {sorted(tags & self.held[i])}, never released")
                self.held[i] |= tags

    def push(self) -> None:
        for i, held in enumerate(self.held):
            assert WEIGHTS in held, f"engine {i}: push into released weights"
            self.weights_valid[i] = True

    def generate(self) -> None:
        for i, held in enumerate(self.held):
            assert held == {WEIGHTS, KV_CACHE} and self.weights_valid[i], f"engine {i} cannot generate"


class Trainer:
    def __init__(self) -> None:
        self.on_device = {"params", "state"}

    def offload(self, keep_params: bool = False) -> None:
        self.on_device = {"params"} if keep_params else set()

    def onload(self) -> None:
        self.on_device = {"params", "state"}


def sync(handoff: MemoryHandoff, engines: StrictEngines, trainer: Trainer) -> None:
    handoff.before_push()
    assert trainer.on_device <= {"params"}  # the optimizer is out while engine weights come back
    engines.push()
    handoff.after_push()


def test_start_pushes_before_the_first_rollout_and_each_step_keeps_the_order():
    engines, trainer = StrictEngines(2), Trainer()
    handoff = MemoryHandoff(engines, trainer, 2, release_engines=True, offload_trainer=True)
    handoff.to_trainer()  # engines loaded, then release before the trainer builds
    with pytest.raises(SlimError, match="released weights"):
        handoff.to_engines()  # resuming alone would serve undefined weights
    for _ in range(3):
        sync(handoff, engines, trainer)
        handoff.to_engines()
        engines.generate()
        handoff.to_trainer()
        assert trainer.on_device == {"params", "state"} and engines.held == [set(), set()]


def test_a_restarted_engine_releases_like_the_fleet_and_is_never_resumed_twice():
    engines, trainer = StrictEngines(3), Trainer()
    handoff = MemoryHandoff(engines, trainer, 3, release_engines=True, offload_trainer=True)
    handoff.to_trainer()
    sync(handoff, engines, trainer)
    handoff.to_engines()
    handoff.to_trainer()  # trained; now engine 1 died and comes back holding everything
    handoff.make_room()
    assert trainer.on_device == set()  # before the restart loads on its device
    engines.held[1], engines.weights_valid[1] = {WEIGHTS, KV_CACHE}, True
    handoff.restarted([1], release=True)
    assert engines.calls[-1] == ("release_memory_occupation", (KV_CACHE, WEIGHTS), (1,))
    sync(handoff, engines, trainer)  # SGLang would raise KeyError on a resume of engine 1 otherwise
    handoff.to_engines()
    engines.generate()


def test_engines_restarted_during_a_rollout_hold_everything_as_the_fleet_does():
    engines, trainer = StrictEngines(2), Trainer()
    handoff = MemoryHandoff(engines, trainer, 2, release_engines=True, offload_trainer=True)
    handoff.to_trainer()
    sync(handoff, engines, trainer)
    handoff.to_engines()  # rollout: both die and restart holding everything
    handoff.restarted([0, 1], release=False)
    handoff.to_trainer()
    sync(handoff, engines, trainer)
    handoff.to_engines()
    engines.generate()


def test_disaggregated_hands_nothing_over():
    engines, trainer = StrictEngines(1), Trainer()
    handoff = MemoryHandoff(engines, trainer, 1, release_engines=False, offload_trainer=False)
    handoff.to_trainer()
    handoff.before_push()
    handoff.after_push()
    handoff.to_engines()
    handoff.restarted([0], release=True)
    assert engines.calls == [] and trainer.on_device == {"params", "state"}
