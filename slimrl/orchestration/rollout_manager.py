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
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.orchestration.launch_plan import EngineSeat

logger = logging.getLogger(__name__)


class EngineActor:
    """Owns one server process (embedded engine on CPU, SGLang on GPU).

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
        self.config, self.index, self.log_dir, self.seat = config, index, Path(log_dir), seat
        self.model_path = model_path or config.model.hf_checkpoint
        """What the server loads: the HF checkpoint, or its block-FP8 copy for an FP8 fleet."""
        self.server: Any = None
        self.restarts = 0

    def base_gpu_id(self) -> int | None:
        """CUDA ordinal of the first GPU of this engine's slots, in what the node lets it see."""
        if self.seat is None or not self.seat.on_gpu:
            return None
        return self.seat.base_gpu_id(os.environ.get("CUDA_VISIBLE_DEVICES"))

    def start(self) -> str:
        from slimrl.rollout.servers import ServerProcess, server_command
        from slimrl.utils.net import free_port

        host = "127.0.0.1" if self.config.ray.address is None else _node_ip()
        port = free_port()
        cmd, env = server_command(self.config, self.model_path, host, port, self.index, self.base_gpu_id())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server = ServerProcess(
            name=f"engine{self.index}", command=cmd, host=host, port=port, env=env,
            log_path=self.log_dir / f"engine{self.index}.log", api_key=self.config.rollout.api_key,
        )  # fmt: skip
        self.server.start()
        self.server.wait_healthy(self.config.rollout.sglang.server_timeout_s)
        (self.log_dir / f"engine{self.index}.pid").write_text(str(self.server.process.pid))
        return self.server.url

    def healthy(self) -> bool:
        return self.server is not None and self.server.alive() and self.server.healthy(timeout=5.0)

    def restart(self) -> str:
        """Replace a dead server (fresh port: the old one may linger in TIME_WAIT)."""
        if self.server is not None:
            self.server.stop()
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def _node_ip() -> str:
    from slimrl.utils.net import node_address

    return node_address()


class RolloutManager:
    """Runs rollouts against the fleet; holds the data source (checkpointed with the run).

    Built in two parts so that it starts while the engines load: `__init__` (tokenizer, data,
    the router process, not yet waited for), then `connect(engine_urls)` once they are healthy."""

    def __init__(self, config: SlimConfig, log_dir: str, engine_urls: list[str] | None = None) -> None:
        from transformers import AutoTokenizer

        from slimrl.rollout.data_source import DataSource
        from slimrl.rollout.router import Router, start_router

        self.config = config
        self.router: Router | None = None
        if config.rollout.router.enabled:
            from slimrl.utils.net import free_port

            self.router = start_router(
                "127.0.0.1", free_port(), config.model.hf_checkpoint, config.rollout.router.policy,
                Path(log_dir) / "router.log",
            )  # fmt: skip
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
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
        """Register the healthy engines with the router, probe what it forwards, open the client."""
        from slimrl.rollout.client import FleetClient
        from slimrl.rollout.generate import RolloutContext
        from slimrl.rollout.router import wait_router_ready
        from slimrl.utils.gc_tuning import freeze_startup_heap

        dropped: set[str] = set()
        if self.router is not None:
            wait_router_ready(self.router)
            for url in engine_urls:
                self.router.register(url)
            dropped = self.router.probe_dropped_fields(prompt_ids=[1, 2, 3])
        config = self.config
        self.client = FleetClient(
            engine_urls,
            router_url=self.router.url if self.router else None,
            router_dropped_fields=dropped,
            api_key=config.rollout.api_key,
            admin_api_key=config.rollout.admin_api_key,
            request_timeout_s=config.rollout.request_timeout_s,
        )
        self.ctx = RolloutContext(config, self.tokenizer, self.client)
        freeze_startup_heap()  # full collections of the start-up heap stalled every rollout

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def generate(self, rollout_id: int) -> tuple[list[list[Any]], dict[str, float]]:
        from slimrl.rollout.rollout import run_rollout

        self.ctx.rollout_id = rollout_id
        result = self._run(run_rollout(self.ctx, self.source))
        metrics = dict(result.metrics)
        metrics["failovers"] = float(self.client.failovers)
        return result.groups, metrics

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        from slimrl.rollout.rollout import run_rollout

        metrics: dict[str, float] = {}
        for name, source in self.evals.items():
            result = self._run(run_rollout(self.ctx, source, evaluation=True))
            metrics.update({f"eval/{name}/{k}": v for k, v in result.metrics.items()})
        return metrics

    def engine_urls(self) -> list[str]:
        return [u for u in self.client.engines if u not in self.client.down]

    def control(self, endpoint: str, payload: dict[str, Any] | None = None) -> list[Any]:
        return self._run(self.client.control(endpoint, payload))

    def replace_engine(self, old: str, new: str) -> None:
        if self.router is not None:
            self.router.deregister(old)
            self.router.register(new)
        self.client.replace_engine(old, new)

    def mark_up(self, urls: list[str]) -> None:
        """Engines found healthy: route to them again (the client marks one down on a failure)."""
        for url in urls:
            self.client.mark_up(url)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    def shutdown(self) -> None:
        if self.client is not None:
            self._run(self.client.close())
        if self.router is not None:
            self.router.process.stop()
            self.router = None
