"""Who holds the devices when trainer and engines share them (`cluster.colocate`).

The engines generate, then hand their memory to the trainer; after training the trainer hands it
back in the order SGLang's memory saver needs for a weight sync:

    rollout -> release engine weights + KV cache -> onload trainer -> train
            -> offload trainer state (parameters stay: the sync reads them) -> resume engine weights
            -> push weights -> offload trainer parameters -> resume engine KV cache -> rollout

As on a GPU, released memory loses its contents (SGLang keeps weights across a release only with
`--enable-weights-cpu-backup`): resumed weights are undefined until a push fills them, so weights
are only ever resumed for a push, never pushed into released memory, and the engines never hold
their KV cache while the trainer holds its optimizer. At start the engines load first and release
before the trainer builds (a 235B bf16 engine load does not fit beside a trainer that holds its
weights and optimizer); the first rollout then runs on pushed weights.

Each engine's holdings are tracked on their own: an engine restarted after a crash holds
everything while the others hold nothing, and SGLang kills its scheduler on a resume of memory
that was never released. Disaggregated runs hand nothing over: every method is then a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from slimrl.errors import SlimError

WEIGHTS, KV_CACHE = "weights", "kv_cache"
BOTH = frozenset({WEIGHTS, KV_CACHE})


class Engines(Protocol):
    def control(
        self, endpoint: str, payload: dict[str, Any] | None = None, only: Sequence[int] | None = None
    ) -> None: ...


class Trainers(Protocol):
    def offload(self, keep_params: bool = False) -> None: ...

    def onload(self) -> None: ...


@dataclass
class MemoryHandoff:
    engines: Engines
    trainers: Trainers
    num_engines: int
    release_engines: bool
    """Engines give their memory back (SGLang's `--enable-memory-saver`; the embedded engine)."""
    offload_trainer: bool
    held: list[set[str]] = field(default_factory=list)
    """What each engine holds now (it loaded everything when it started)."""
    trainer_offloaded: bool = False

    def __post_init__(self) -> None:
        self.held = [set(BOTH) for _ in range(self.num_engines)]

    def to_trainer(self) -> None:
        """Before the trainer builds or trains."""
        self._release(BOTH)
        if self.offload_trainer and self.trainer_offloaded:
            self.trainers.onload()
            self.trainer_offloaded = False

    def before_push(self) -> None:
        if self.offload_trainer:
            if self.trainer_offloaded:  # parameters back; the rest goes out again just below
                self.trainers.onload()
            self.trainers.offload(keep_params=True)  # everything but the parameters
            self.trainer_offloaded = False
        self._resume(WEIGHTS)

    def after_push(self) -> None:
        if self.offload_trainer:
            self.trainers.offload()  # now the parameters too
            self.trainer_offloaded = True
        self._resume(KV_CACHE)

    def for_retry(self) -> None:
        """After a push whose check failed, before pushing it again: the KV cache goes, as before
        the first push (the engines keep the weights the retry overwrites)."""
        self._release(frozenset({KV_CACHE}))

    def to_engines(self) -> None:
        """Before a rollout: engines hold everything. Right after a sync this is a no-op; weights
        released and not pushed since would be served undefined, so that is refused."""
        short = [i for i, tags in enumerate(self.held) if WEIGHTS not in tags]
        if short:
            raise SlimError(f"engines {short} would generate from released weights: push weights first")
        self._resume(KV_CACHE)
        if self.offload_trainer and not self.trainer_offloaded:
            self.trainers.offload()
            self.trainer_offloaded = True

    def make_room(self) -> None:
        """Before engines restart: a starting engine loads its weights and KV cache at once, so
        the trainer's state leaves the devices first (on a GPU it would not fit beside it)."""
        if self.offload_trainer and not self.trainer_offloaded:
            self.trainers.offload()
            self.trainer_offloaded = True

    def restarted(self, indices: Sequence[int], release: bool) -> None:
        """Engines `indices` started again and hold everything; with `release`, they give it back
        now, as the rest of the fleet has (the next push resumes them with the others)."""
        for index in indices:
            self.held[index] = set(BOTH)
        if release and indices:
            self._release(BOTH, list(indices))

    def _release(self, tags: frozenset[str], among: Sequence[int] | None = None) -> None:
        if not self.release_engines:
            return
        candidates = range(self.num_engines) if among is None else among
        for held in {frozenset(self.held[i] & tags) for i in candidates} - {frozenset()}:
            only = [i for i in candidates if frozenset(self.held[i] & tags) == held]
            self.engines.control("release_memory_occupation", {"tags": sorted(held)}, only=only)
            for i in only:
                self.held[i] -= held

    def _resume(self, tag: str) -> None:
        if not self.release_engines:
            return
        only = [i for i in range(self.num_engines) if tag not in self.held[i]]
        if only:
            self.engines.control("resume_memory_occupation", {"tags": [tag]}, only=only)
            for i in only:
                self.held[i].add(tag)
