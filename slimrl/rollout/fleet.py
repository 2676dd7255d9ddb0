"""The rollout fleet: N inference servers, optionally behind sglang-router, and their health.

`Fleet` owns server processes on this host (the `slimrl rollout` command and tests); under Ray
(`slimrl train`) each server is owned by an engine actor instead, with the same `ServerProcess`
inside. Either way the rollout code talks to the fleet only through `FleetClient`.

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
from slimrl.rollout.router import Router, start_router, wait_router_ready
from slimrl.rollout.servers import ServerProcess, server_command
from slimrl.utils.net import free_port

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"
T = TypeVar("T")


class Fleet:
    def __init__(self, config: SlimConfig, model_path: str, log_dir: Path) -> None:
        self.config = config
        self.model_path = str(model_path)
        self.log_dir = Path(log_dir)
        self.servers: list[ServerProcess] = []
        self.router: Router | None = None
        self.client: FleetClient | None = None
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopped = False

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _new_server(self, index: int) -> ServerProcess:
        port = free_port()
        cmd, env = server_command(self.config, self.model_path, HOST, port, index)
        return ServerProcess(
            name=f"engine{index}",
            command=cmd,
            host=HOST,
            port=port,
            env=env,
            log_path=self.log_dir / f"engine{index}.log",
            api_key=self.config.rollout.api_key,
        )

    def start(self) -> FleetClient:
        """Start every engine and the router at once, wait for all, register the engines with the
        router and probe what it forwards; on any failure stop what started."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._stopped = False
        timeout = self.config.rollout.sglang.server_timeout_s
        try:
            self.servers = [self._new_server(i) for i in range(self.config.rollout.num_engines)]
            for server in self.servers:
                server.start()
            if self.config.rollout.router.enabled:
                self.router = start_router(
                    HOST,
                    free_port(),
                    self.model_path,
                    self.config.rollout.router.policy,
                    self.log_dir / "router.log",
                )
            for server in self.servers:
                server.wait_healthy(timeout)
            dropped: set[str] = set()
            if self.router is not None:
                wait_router_ready(self.router)
                for server in self.servers:
                    self.router.register(server.url)
                dropped = self.router.probe_dropped_fields([1, 2, 3], engine_url=self.servers[0].url)
        except BaseException:
            self.stop()
            raise
        self.client = FleetClient(
            [s.url for s in self.servers],
            router_url=self.router.url if self.router else None,
            router_dropped_fields=dropped,
            api_key=self.config.rollout.api_key,
            admin_api_key=self.config.rollout.admin_api_key,
            request_timeout_s=self.config.rollout.request_timeout_s,
        )
        logger.info(
            "fleet up: %d engines%s", len(self.servers), " behind sglang-router" if self.router else ""
        )
        return self.client

    def pids(self) -> list[int]:
        """Process ids of every server and the router (the process-group leaders we started)."""
        processes = [*self.servers, *([self.router.process] if self.router else [])]
        return [p.process.pid for p in processes if p.process is not None]

    def dead_servers(self) -> list[ServerProcess]:
        return [s for s in self.servers if not s.alive() or not s.healthy(timeout=5.0)]

    def restart_dead(self) -> list[tuple[str, str]]:
        """Restart every dead engine on a fresh port and swap it in the router (blocking; does
        not touch the client, so it may run in a thread). Returns (old url, new url) pairs.

        A fresh port because the old one may still be in TIME_WAIT, and because a request the
        router still holds for the old address must fail rather than reach a different server.
        """
        replaced = []
        for index, server in enumerate(list(self.servers)):
            if server.alive() and server.healthy(timeout=5.0):
                continue
            logger.warning("%s at %s is down; restarting it", server.name, server.url)
            if self.router is not None:
                self.router.deregister(server.url)
            replacement = self._new_server(index)
            replacement.restarts = server.restarts + 1
            with self._lock:
                if self._stopped:  # stop() won the race: start nothing it would not stop
                    return replaced
                server.stop()
                replacement.start()
                self.servers[index] = replacement
            replacement.wait_healthy(self.config.rollout.sglang.server_timeout_s)
            if self.router is not None:
                self.router.register(replacement.url)
            self.restarts += 1
            replaced.append((server.url, replacement.url))
        return replaced

    def heal(self) -> list[str]:
        """Restart dead engines and swap them into the router and the client; returns new URLs."""
        replaced = self.restart_dead()
        self._swap_into_client(replaced)
        return [new for _, new in replaced]

    def _swap_into_client(self, replaced: list[tuple[str, str]]) -> None:
        if self.client is None:
            return
        for old, new in replaced:
            self.client.replace_engine(old, new)
        for server in self.servers:  # every listed server is healthy now
            self.client.mark_up(server.url)

    async def watch(self, interval_s: float = 5.0) -> None:
        """Background task: heal the fleet whenever the client saw an engine fail or one exited.

        The blocking restart runs in a daemon thread (a shutdown must not wait for it); the client
        is updated back on the event loop, which owns it.
        """
        while True:
            await asyncio.sleep(interval_s)
            if self.client is None or (not self.client.down and all(s.alive() for s in self.servers)):
                continue
            try:
                replaced = await _in_daemon_thread(self.restart_dead)
            except SlimError as exc:
                logger.error("could not heal the fleet (will retry): %s", exc)
                continue
            self._swap_into_client(replaced)

    def stop(self) -> None:
        """Stop every process we started (engines, then the router); idempotent."""
        errors = []
        with self._lock:
            self._stopped = True
            for process in [*self.servers, *([self.router.process] if self.router else [])]:
                try:
                    process.stop()
                except Exception as exc:  # keep stopping the others
                    errors.append(f"{process.name}: {exc}")
            self.servers, self.router = [], None
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
