"""Who holds the devices when trainer and engines share them (`cluster.colocate`).

The engines generate, then hand their memory to the trainer; after training the trainer hands it
back in the order SGLang's memory saver needs for a weight sync:

    rollout -> release engine weights + KV cache -> onload trainer -> train
            -> offload trainer state (parameters stay: the sync reads them) -> resume engine weights
            -> push weights -> offload trainer parameters -> resume engine KV cache -> rollout

Weights are never pushed into released memory, and the engines never hold their KV cache while the
trainer holds its optimizer. At start the engines load first and release before the trainer
builds (a 235B bf16 engine load does not fit beside a trainer that holds its weights and optimizer).
Disaggregated runs hand nothing over: every method is then a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

WEIGHTS, KV_CACHE = "weights", "kv_cache"


class Engines(Protocol):
    def control(self, endpoint: str, payload: dict[str, Any] | None = None) -> None: ...


class Trainers(Protocol):
    def offload(self, keep_params: bool = False) -> None: ...

    def onload(self) -> None: ...


@dataclass
class MemoryHandoff:
    engines: Engines
    trainers: Trainers
    release_engines: bool
    """Engines give their memory back (SGLang's `--enable-memory-saver`; not on a CPU SGLang)."""
    offload_trainer: bool
    engines_hold: set[str] = field(default_factory=lambda: {WEIGHTS, KV_CACHE})
    trainer_offloaded: bool = False

    def to_trainer(self) -> None:
        """Before the trainer builds or trains."""
        if self.release_engines and self.engines_hold:
            self.engines.control("release_memory_occupation", {"tags": sorted(self.engines_hold)})
            self.engines_hold.clear()
        if self.offload_trainer and self.trainer_offloaded:
            self.trainers.onload()
            self.trainer_offloaded = False

    def before_push(self) -> None:
        if self.offload_trainer:
            self.trainers.offload(keep_params=True)  # everything but the parameters
        self._resume(WEIGHTS)

    def after_push(self) -> None:
        if self.offload_trainer:
            self.trainers.offload()  # now the parameters too
            self.trainer_offloaded = True
        self._resume(KV_CACHE)

    def to_engines(self) -> None:
        """Before a rollout: engines hold everything (a no-op right after a sync)."""
        engines_short = self.release_engines and self.engines_hold != {WEIGHTS, KV_CACHE}
        if engines_short or (self.offload_trainer and not self.trainer_offloaded):
            self.before_push()
            self.after_push()

    def _resume(self, tag: str) -> None:
        if self.release_engines and tag not in self.engines_hold:
            self.engines.control("resume_memory_occupation", {"tags": [tag]})
            self.engines_hold.add(tag)
