"""What the driver may ask of a trainer rank across Ray: the one seam between `orchestration` and
`trainer`. `TrainerGroup` names the methods of `TrainerRank` (never a string), `MegatronActor`
implements it, and `tests/test_trainer_plumbing.py` checks the two agree name for name and
parameter for parameter, so a reader (or a type checker) follows a step from the driver into the
rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from slimrl.trainer.batch import TrainBatch


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

    def probe_logprobs(self, tokens: list[int]) -> list[float] | None:
        """Logprobs of `tokens[1:]` (the update check's probe); None on ranks that compute none."""
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
