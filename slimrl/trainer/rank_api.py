"""What the driver may ask of a trainer rank across Ray: the one seam between `orchestration` and
`trainer`. `TrainerGroup` names the methods of `TrainerRank` (never a string), `MegatronActor`
implements it, and `tests/test_trainer_plumbing.py` checks the two agree name for name and
parameter for parameter, so a reader (or a type checker) follows a step from the driver into the
rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from slimrl.trainer.batch import TrainBatch


@dataclass(frozen=True)
class ProbeScore:
    """One rank's part of the update check's probe (`trainer/router_margins.py`)."""

    logprobs: list[float] | None
    """Logprobs of the probe's tokens 1 on; None on ranks that compute none (not the last stage)."""
    margins: dict[int, float] = field(default_factory=dict)
    """MoE only: per input position, the smallest decision margin of this rank's routers."""
    tie_at: int | None = None
    """The first position where one of them is a near tie (`router_margins.ROUTER_TIE`): from
    there on the engine may rightly route otherwise, so only logprobs `[:tie_at]` compare."""

    @property
    def compared(self) -> list[float]:
        """The logprobs the engines must match: those computed from positions before any tie."""
        assert self.logprobs is not None
        return self.logprobs if self.tie_at is None else self.logprobs[: self.tie_at]


def merged_probe(answers: list[ProbeScore]) -> ProbeScore:
    """Every rank's part in one: the last stage's logprobs, per position the smallest margin over
    all ranks (each routes its own layers and, under sequence parallelism, its own tokens), and
    the first near tie of any rank."""
    margins: dict[int, float] = {}
    for answer in answers:
        for position, margin in answer.margins.items():
            margins[position] = min(margin, margins.get(position, margin))
    ties = [a.tie_at for a in answers if a.tie_at is not None]
    logprobs = next(a.logprobs for a in answers if a.logprobs is not None)
    return ProbeScore(logprobs, margins, min(ties, default=None))


class TrainerRank(Protocol):
    def setup(self, total_steps: int) -> dict[str, Any]:
        """Build model, optimizer and scheduler (and load a checkpoint or HF weights); a summary."""
        ...

    def coordinates(self) -> dict[str, int]:
        """This rank's place in every parallel group (`dp`, `tp`, `pp`, ...)."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One supervised optimizer step on this DP rank's share."""
        ...

    def train_rl(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout's RL updates on this DP rank's share."""
        ...

    def probe_logprobs(self, tokens: list[int]) -> ProbeScore:
        """The update check's probe: logprobs of `tokens[1:]` and the routers' margins."""
        ...

    def push_weights(
        self, urls: list[str], transport: str, version: str, sync_dir: str | None = None,
        trace_dir: str | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Stream this rank's share of the weights to the engines; its weights fingerprint."""
        ...

    def save_checkpoint(self, directory: str) -> None: ...

    def load_checkpoint(self, directory: str) -> int:
        """The step the checkpoint was saved at."""
        ...

    def offload(self, keep_params: bool = False) -> int:
        """Training state to host memory; the bytes moved."""
        ...

    def onload(self) -> None: ...
