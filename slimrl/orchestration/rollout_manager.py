"""Ray actors of the rollout side: one engine actor per inference server (it launches and owns
the server process on its devices) and the rollout manager (router, fleet client, data, the loop).

The driver never talks HTTP to engines: it asks the manager for a rollout, for control calls
(pause, continue, memory release) and for the engines' URLs (weight sync from the trainers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimrl.config.schema import SlimConfig
from slimrl.data.hf_tokenizer import load_tokenizer
from slimrl.devices.launch_plan import EngineSeat
from slimrl.rollout.engine import LOCALHOST, EngineProcess
from slimrl.rollout.front import FleetFront
from slimrl.utils.gc_tuning import freeze_startup_heap
from slimrl.utils.hang import register_stack_signal
from slimrl.utils.net import node_address

if TYPE_CHECKING:
    from slimrl.rollout.rollout import RolloutResult

logger = logging.getLogger(__name__)


class EngineActor(EngineProcess):
    """An `EngineProcess` as a Ray actor on its node: listens on the node's address under a Ray cluster
    of several hosts, and on GPUs starts at its seat's first GPU.

    On GPUs the actor runs with Ray's `CUDA_VISIBLE_DEVICES` switch off (`seat.actor_env`), so its
    server sees every GPU of the node and is pointed at its own by `--base-gpu-id`.
    """

    def __init__(
        self,
        config: SlimConfig,
        index: int,
        log_dir: str,
        seat: EngineSeat | None = None,
        model_path: str | None = None,
    ) -> None:
        super().__init__(config, index, log_dir, model_path)
        self.seat = seat

    def host(self) -> str:
        return LOCALHOST if self.config.ray.address is None else node_address()

    def base_gpu_id(self) -> int | None:
        if self.seat is None or not self.seat.on_gpu:
            return None
        return self.seat.base_gpu_id(os.environ.get("CUDA_VISIBLE_DEVICES"))


class RolloutManager:
    """Runs rollouts against the fleet; holds the data source (checkpointed with the run).

    Built in two parts so that it starts while the engines load: `__init__` (tokenizer, data,
    the router process, not yet waited for), then `connect(engine_urls)` once they are healthy."""

    def __init__(self, config: SlimConfig, log_dir: str, engine_urls: list[str] | None = None) -> None:

        register_stack_signal()  # stacks on demand when a wait of the run expires
        self.config = config
        self.front = FleetFront(config, Path(log_dir))  # first: the router starts while we load
        from slimrl.rollout.data_source import DataSource

        self.tokenizer = load_tokenizer(config.model.hf_checkpoint, config.model.trust_remote_code)
        self.source = DataSource(config)
        self.evals = {
            name: DataSource(config, path, shuffle=False) for name, path in config.eval.datasets.items()
        }
        self.client: Any = None
        self.ctx: Any = None
        # One event loop on its own thread: the actor serves several calls at once (a control call
        # such as pause must not wait for a running rollout), all of them on this loop.
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        if engine_urls is not None:
            self.connect(engine_urls)

    def connect(self, engine_urls: list[str]) -> None:
        """Connect the front to the healthy engines and open the rollout context."""
        from slimrl.rollout.generate import RolloutContext

        self.client = self.front.connect(engine_urls)
        self.ctx = RolloutContext(self.config, self.tokenizer, self.client)
        freeze_startup_heap()  # full collections of the start-up heap stalled every rollout

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def generate(self, rollout_id: int) -> RolloutResult:
        """The rollout of `rollout_id`: its groups, metrics (with the client's failovers) and the
        groups set aside unfinished."""
        from slimrl.rollout.rollout import run_rollout

        self.ctx.rollout_id = rollout_id
        result = self._run(run_rollout(self.ctx, self.source))
        result.metrics["failovers"] = float(self.client.failovers)
        return result

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        from slimrl.rollout.rollout import run_rollout

        metrics: dict[str, float] = {}
        for name, source in self.evals.items():
            result = self._run(run_rollout(self.ctx, source, evaluation=True))
            metrics.update({f"eval/{name}/{k}": v for k, v in result.metrics.items()})
        return metrics

    def engine_urls(self) -> list[str]:
        return [u for u in self.client.engines if u not in self.client.down]

    def control(
        self, endpoint: str, payload: dict[str, Any] | None = None, urls: list[str] | None = None
    ) -> list[Any]:
        """A control call to every live engine, or to those of `urls`."""
        return self._run(self.client.control(endpoint, payload, urls=urls))

    def swap(self, replaced: list[tuple[str, str]], engine_urls: list[str]) -> None:
        """Restarted engines into the router and client, every healthy one routed to again; on
        the loop, which may be running a rollout (async runs) with the client."""

        async def on_loop() -> None:
            self.front.swap(replaced, engine_urls)

        self._run(on_loop())

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    def shutdown(self) -> None:
        from slimrl.rollout.agent.runner import close_agents

        if self.ctx is not None:
            self._run(close_agents(self.ctx))  # agent runs parked by the last rollout
        if self.client is not None:
            self._run(self.client.close())
        self.front.stop()
