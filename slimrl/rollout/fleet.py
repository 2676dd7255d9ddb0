"""The rollout fleet of `slimrl rollout` (and tests): N engines in this process, their front
(router and client), and their health.

Its parts are the ones `slimrl train` runs under Ray: each `EngineProcess` there is an actor on its
node and the `FleetFront` lives in the rollout manager (`orchestration/ray_fleet.py`); only the
driver around them differs. The rollout code talks to either only through `FleetClient`.

    with Fleet(config, model_path, log_dir) as fleet:   # start(): engines, router, probe
        await fleet.client.generate(...)
        fleet.heal()                                      # restart dead engines on new ports
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError
from slimrl.rollout.client import FleetClient
from slimrl.rollout.engine import EngineProcess
from slimrl.rollout.front import FleetFront
from slimrl.rollout.router import Router
from slimrl.rollout.servers import ServerProcess

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Fleet:
    def __init__(self, config: SlimConfig, model_path: str, log_dir: Path) -> None:
        self.config = config
        self.model_path = str(model_path)
        self.log_dir = Path(log_dir)
        self.engines: list[EngineProcess] = []
        self.front: FleetFront | None = None
        self.restarts = 0

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def client(self) -> FleetClient | None:
        return self.front.client if self.front else None

    @property
    def router(self) -> Router | None:
        return self.front.router if self.front else None

    @property
    def servers(self) -> list[ServerProcess]:
        return [e.server for e in self.engines if e.server is not None]

    def start(self) -> FleetClient:
        """Start every engine and the router at once, wait for all, then connect the front; on
        any failure stop what started."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.engines = [
                EngineProcess(self.config, i, self.log_dir, self.model_path)
                for i in range(self.config.rollout.num_engines)
            ]
            for engine in self.engines:
                engine.spawn()
            self.front = FleetFront(self.config, self.log_dir)
            urls = [engine.wait() for engine in self.engines]
            return self.front.connect(urls)
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        """Process ids of every server and the router (the process-group leaders we started)."""
        processes = [*self.servers, *([self.router.process] if self.router else [])]
        return [p.process.pid for p in processes if p.process is not None]

    def restart_dead(self) -> list[tuple[str, str]]:
        """Restart every dead engine on a fresh port (blocking; touches neither router nor client,
        so it may run in a thread). Returns (old url, new url) pairs."""
        replaced = []
        for engine in list(self.engines):
            if engine.healthy():
                continue
            old = engine.url
            logger.warning("engine%d at %s is down; restarting it", engine.index, old)
            try:
                replaced.append((old, engine.restart()))
            except SlimError:
                if engine in self.engines:  # not stopped meanwhile: a real failure
                    raise
                return replaced
            self.restarts += 1
        return replaced

    def heal(self) -> list[str]:
        """Restart dead engines and swap them into the router and the client; returns new URLs."""
        replaced = self.restart_dead()
        self._swap(replaced)
        return [new for _, new in replaced]

    def _swap(self, replaced: list[tuple[str, str]]) -> None:
        if self.front is not None and self.front.client is not None:
            self.front.swap(replaced, [e.url for e in self.engines])  # every listed engine is healthy now

    async def watch(self, interval_s: float = 5.0) -> None:
        """Background task: heal the fleet whenever the client saw an engine fail or one exited.

        The blocking restart runs in a daemon thread (a shutdown must not wait for it); the front
        is updated back on the event loop, which owns the client.
        """
        while True:
            await asyncio.sleep(interval_s)
            client = self.client
            if client is None or (not client.down and all(s.alive() for s in self.servers)):
                continue
            try:
                replaced = await _in_daemon_thread(self.restart_dead)
            except SlimError as exc:
                logger.error("could not heal the fleet (will retry): %s", exc)
                continue
            self._swap(replaced)

    def stop(self) -> None:
        """Stop every process we started (engines, then the router); idempotent."""
        errors = []
        engines, front = self.engines, self.front
        self.engines, self.front = [], None
        stops = [(f"engine{e.index}", e.stop) for e in engines] + ([("router", front.stop)] if front else [])
        for name, stop in stops:
            try:
                stop()
            except Exception as exc:  # keep stopping the others
                errors.append(f"{name}: {exc}")
        if errors:
            raise SlimError("could not stop " + "; ".join(errors))


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run blocking `fn` in a daemon thread: unlike `asyncio.to_thread`, interpreter and event-loop
    shutdown do not wait for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="fleet-heal", daemon=True).start()
    return await future
