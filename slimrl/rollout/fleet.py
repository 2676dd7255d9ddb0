"""The rollout fleet: N inference servers, optionally behind sglang-router, and their health.

`Fleet` owns server processes on this host (the `slimrl rollout` command and tests); under Ray
(`slimrl train`) each server is owned by an engine actor instead, with the same `ServerProcess`
inside. Either way the rollout code talks to the fleet only through `FleetClient`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError
from slimrl.orchestration.placement import free_port
from slimrl.rollout.client import FleetClient
from slimrl.rollout.router import Router, launch_router
from slimrl.rollout.servers import ServerProcess, server_command

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"


class Fleet:
    def __init__(self, config: SlimConfig, model_path: str, log_dir: Path) -> None:
        self.config = config
        self.model_path = model_path
        self.log_dir = log_dir
        self.servers: list[ServerProcess] = []
        self.router: Router | None = None
        self.client: FleetClient | None = None
        self.restarts = 0

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
        self.log_dir.mkdir(parents=True, exist_ok=True)
        timeout = self.config.rollout.sglang.server_timeout_s
        try:
            self.servers = [self._new_server(i) for i in range(self.config.rollout.num_engines)]
            for server in self.servers:
                server.start()
            for server in self.servers:
                server.wait_healthy(timeout)
            dropped: set[str] = set()
            if self.config.rollout.router.enabled:
                self.router = launch_router(
                    HOST,
                    free_port(),
                    self.model_path,
                    self.config.rollout.router.policy,
                    self.log_dir / "router.log",
                )
                for server in self.servers:
                    self.router.register(server.url)
                dropped = self.router.probe_dropped_fields(prompt_ids=[1, 2, 3])
        except BaseException:
            self.stop()
            raise
        self.client = FleetClient(
            [s.url for s in self.servers],
            router_url=self.router.url if self.router else None,
            router_dropped_fields=dropped,
            api_key=self.config.rollout.api_key,
            request_timeout_s=self.config.rollout.request_timeout_s,
        )
        logger.info(
            "fleet up: %d engines%s", len(self.servers), " behind sglang-router" if self.router else ""
        )
        return self.client

    def dead_servers(self) -> list[ServerProcess]:
        return [s for s in self.servers if not s.alive() or not s.healthy(timeout=5.0)]

    def heal(self) -> list[str]:
        """Restart every dead engine on a fresh port, swap it in the router and the client."""
        restarted = []
        for index, server in enumerate(self.servers):
            if server.alive() and server.healthy(timeout=5.0):
                if self.client is not None:
                    self.client.mark_up(server.url)
                continue
            logger.warning("%s at %s is down; restarting it", server.name, server.url)
            old_url = server.url
            if self.router is not None:
                self.router.deregister(old_url)
            server.stop()
            replacement = self._new_server(index)
            replacement.restarts = server.restarts + 1
            replacement.start()
            replacement.wait_healthy(self.config.rollout.sglang.server_timeout_s)
            self.servers[index] = replacement
            if self.router is not None:
                self.router.register(replacement.url)
            if self.client is not None:
                self.client.replace_engine(old_url, replacement.url)
            self.restarts += 1
            restarted.append(replacement.url)
        return restarted

    def stop(self) -> None:
        errors = []
        for process in [*(s for s in self.servers), *([self.router.process] if self.router else [])]:
            try:
                process.stop()
            except Exception as exc:  # keep stopping the others
                errors.append(f"{process.name}: {exc}")
        self.servers, self.router = [], None
        if errors:
            raise SlimError("could not stop " + "; ".join(errors))
