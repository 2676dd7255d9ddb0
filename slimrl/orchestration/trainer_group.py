"""The Megatron actors as one group: placement, set-up, and fan-out of per-DP-rank batches."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from slimrl.checkpoint_dir import new_tmp_dir, publish
from slimrl.compat import megatron_cpu
from slimrl.config.schema import SlimConfig
from slimrl.devices.ledger import Ledger
from slimrl.orchestration.placement import DeviceSlots, trainer_actor_options, trainer_env
from slimrl.trainer.batch import TrainBatch
from slimrl.trainer.distributed import RankInfo
from slimrl.trainer.rank_api import ProbeScore, TrainerRank, merged_probe
from slimrl.utils.gc_tuning import freeze_startup_heap
from slimrl.utils.hang import Hung, register_stack_signal
from slimrl.utils.net import free_port, node_address
from slimrl.weight_sync.collectives import hang_report

T = TypeVar("T")


def _ranges(ranks: list[int]) -> str:
    """0,1,2,5 -> '0-2, 5'."""
    parts: list[str] = []
    for rank in ranks:
        if parts and parts[-1].split("-")[-1] == str(rank - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{rank}"
        else:
            parts.append(str(rank))
    return ", ".join(parts)


class _RankAddress:
    """Tiny actor-side helper: where rank 0 listens for torch.distributed rendezvous."""

    @staticmethod
    def pick() -> tuple[str, int]:

        return node_address(), free_port()


class TrainerGroup:
    def __init__(
        self,
        config: SlimConfig,
        slots: DeviceSlots,
        world_size: int,
        share: float,
        ledger: Ledger | None = None,
    ) -> None:
        import ray

        self.config = config
        remote_actor = ray.remote(_ActorHost)
        env = trainer_env(config, "cuda" if slots.use_gpu else "cpu")
        first = remote_actor.options(**trainer_actor_options(slots, 0, share, env))
        self.world_size = world_size
        self.actors = [first.remote()]
        address = self.actors[0].pick_address.remote()  # Ray hands the result to every create()
        for rank in range(1, world_size):
            options = remote_actor.options(**trainer_actor_options(slots, rank, share, env))
            self.actors.append(options.remote())
        # Not waited for here: the rank processes start and import while the caller goes on (the
        # RL loop starts the rollout fleet meanwhile); setup() collects them, and their errors.
        self._created = [
            actor.create.remote(config, rank, world_size, address, ledger)
            for rank, actor in enumerate(self.actors)
        ]
        self.dp_rank_of: list[int] = []
        self.pid_of: dict[str, int] = {}

    def setup(self, total_steps: int) -> list[dict[str, Any]]:
        import ray

        ray.get(self._created)
        summaries = ray.get([a.call.remote(TrainerRank.setup.__name__, total_steps) for a in self.actors])
        coords = ray.get([a.call.remote(TrainerRank.coordinates.__name__) for a in self.actors])
        ray.get([a.freeze_startup_heap.remote() for a in self.actors])
        self.dp_rank_of = [c["dp"] for c in coords]
        self.pid_of = self.pids()  # asked now: an actor stuck in a call answers nothing else
        return summaries

    @property
    def dp_size(self) -> int:
        return max(self.dp_rank_of) + 1

    def run(self, method: Callable[..., T], per_dp: list[Any] | None = None, *args: Any) -> list[T]:
        """Call `method` (a `TrainerRank` method) on every rank; with `per_dp`, rank r gets
        per_dp[its DP rank] first. Bounded by `train.step_timeout_s`: past it, Hung names the ranks
        still working."""
        import ray

        name = method.__name__
        calls = []
        for actor, dp_rank in zip(self.actors, self.dp_rank_of, strict=True):
            head = (per_dp[dp_rank],) if per_dp is not None else ()
            calls.append(actor.call.remote(name, *head, *args))
        timeout = self.config.train.step_timeout_s
        _, pending = ray.wait(calls, num_returns=len(calls), timeout=timeout)
        if pending:
            ranks = [rank for rank, call in enumerate(calls) if call in pending]
            raise Hung(
                f"trainer call {name} did not finish in {timeout:.0f} s (train.step_timeout_s): the "
                f"driver waits for trainer rank(s) {_ranges(ranks)} of {self.world_size}"
            )
        return ray.get(calls)

    def pids(self) -> dict[str, int]:
        """Process id of every trainer rank, by name (for stacks of a hang)."""
        import ray

        pids = ray.get([a.pid.remote() for a in self.actors])
        return {f"trainer_rank{rank}": pid for rank, pid in enumerate(pids)}

    def train_step(self, per_dp: list[TrainBatch]) -> dict[str, float]:
        results = self.run(TrainerRank.train_step, per_dp)
        merged: dict[str, float] = {}
        for result in results:  # only last-pipeline-stage ranks report the loss
            for key, value in result.items():
                merged.setdefault(key, value)
        return merged

    def train_rl(self, per_dp: list[TrainBatch]) -> dict[str, float]:
        """One rollout's updates; metrics come from the ranks that compute losses."""
        merged: dict[str, float] = {}
        for result in self.run(TrainerRank.train_rl, per_dp):
            for key, value in result.items():
                if key not in merged or (key.startswith("train/") and "train/pg_loss" in result):
                    merged[key] = value
        return merged

    def probe_logprobs(self, tokens: list[int]) -> ProbeScore:
        """The trainer's score of the update check's probe `tokens`, every rank's part merged."""
        return merged_probe(self.run(TrainerRank.probe_logprobs, None, tokens))

    def save_checkpoint(self, root: Path, step: int, driver_state: dict[str, Any], keep_last: int) -> Path:
        """All ranks write into a fresh temporary directory; then it is published atomically."""

        tmp = new_tmp_dir(root, step)
        try:
            self.run(TrainerRank.save_checkpoint, None, str(tmp))
        except BaseException:  # e.g. SIGTERM mid-save: stop the writers, then drop what they wrote
            self.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return publish(root, tmp, step, driver_state, keep_last)

    def load_checkpoint(self, path: Path) -> None:
        self.run(TrainerRank.load_checkpoint, None, str(path))

    def offload(self, keep_params: bool = False) -> None:
        """Move every rank's training state to host memory (`keep_params`: all but the parameters)."""
        self.run(TrainerRank.offload, None, keep_params)

    def onload(self) -> None:
        self.run(TrainerRank.onload)

    def push_weights(
        self,
        urls: list[str],
        transport: str,
        version: int,
        sync_dir: str | None,
        trace_dir: Path,
        timeout_s: float,
    ) -> list[tuple[float, float]]:
        """Every rank streams its share of the weights to the engines (`trainer/weight_sync.py`).
        A sync past `timeout_s` is hung: one line names what every rank waits in. Returns every
        rank's weights fingerprint (equal to the last push's only if no weight moved)."""
        import ray
        from ray.exceptions import GetTimeoutError

        push = TrainerRank.push_weights.__name__  # bounded by its own timeout, not run()'s
        args = (urls, transport, str(version), sync_dir, str(trace_dir))
        calls = [a.call.remote(push, *args) for a in self.actors]
        try:
            return [result["fingerprint"] for result in ray.get(calls, timeout=timeout_s)]
        except GetTimeoutError:
            raise Hung(
                f"weight sync to version {version} did not finish in {timeout_s:.0f} s "
                f"(rollout.weight_sync_timeout_s): {hang_report(trace_dir, self.world_size)}"
            ) from None

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


class _ActorHost:
    """Ray actor body: hosts a MegatronActor, created after the rendezvous address is known."""

    def __init__(self) -> None:
        self.actor: Any = None

    def pick_address(self) -> tuple[str, int]:
        return _RankAddress.pick()

    def pid(self) -> int:
        import os

        return os.getpid()

    def create(
        self, config: SlimConfig, rank: int, world_size: int, address: tuple[str, int], ledger: Ledger | None
    ) -> None:
        from slimrl.trainer.actor import MegatronActor

        register_stack_signal()  # stacks on demand when a wait on this rank expires
        master_addr, master_port = address
        info = RankInfo(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port)
        self.actor = MegatronActor(config, info, ledger)
        # The first thing setup() does, done now while the fleet starts: on CPU, import and patch
        # Megatron-Core (seconds of imports, no memory); a no-op on GPU machines.
        megatron_cpu.apply()

    def call(self, method: str, *args: Any) -> Any:
        """`method`: the name of a `TrainerRank` method (Ray carries names, not functions)."""
        return getattr(self.actor, method)(*args)

    def freeze_startup_heap(self) -> int:
        """After set-up: Megatron, torch and the model stay out of later garbage collections."""

        return freeze_startup_heap()
