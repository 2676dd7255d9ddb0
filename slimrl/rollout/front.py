"""The fleet's front: sglang-router (optional, a subprocess) and the `FleetClient` that every
request goes through. One implementation for both drivers: in-process for `slimrl rollout`,
inside the rollout manager actor for `slimrl train`."""

from __future__ import annotations

import logging
from pathlib import Path

from slimrl.config.schema import SlimConfig
from slimrl.rollout.client import FleetClient
from slimrl.rollout.engine import LOCALHOST
from slimrl.rollout.router import Router, start_router, wait_router_ready
from slimrl.utils.net import free_port

logger = logging.getLogger(__name__)
PROBE_PROMPT = [1, 2, 3]


class FleetFront:
    def __init__(self, config: SlimConfig, log_dir: Path) -> None:
        """Starts the router now, so that it comes up while the engines load."""
        self.config = config
        self.router: Router | None = None
        self.client: FleetClient | None = None
        if config.rollout.router.enabled:
            self.router = start_router(
                LOCALHOST, free_port(), config.model.hf_checkpoint, config.rollout.router.policy,
                Path(log_dir) / "router.log",
            )  # fmt: skip

    def connect(self, engine_urls: list[str]) -> FleetClient:
        """Register the healthy engines with the router, probe which request fields it drops (those
        requests go straight to an engine), open the client."""
        dropped: set[str] = set()
        if self.router is not None:
            wait_router_ready(self.router)
            for url in engine_urls:
                self.router.register(url)
            dropped = self.router.probe_dropped_fields(PROBE_PROMPT)
        rollout = self.config.rollout
        self.client = FleetClient(
            engine_urls,
            router_url=self.router.url if self.router else None,
            router_dropped_fields=dropped,
            api_key=rollout.api_key,
            admin_api_key=rollout.admin_api_key,
            request_timeout_s=rollout.request_timeout_s,
        )
        logger.info(
            "fleet up: %d engines%s", len(engine_urls), " behind sglang-router" if self.router else ""
        )
        return self.client

    def swap(self, replaced: list[tuple[str, str]], engine_urls: list[str]) -> None:
        """Restarted engines (old URL, new URL) take their predecessors' places in the router and
        the client; every engine in `engine_urls` answered its health check, so it is routed to
        again. Call it on the thread that runs the client's requests."""
        assert self.client is not None, "connect() first"
        for old, new in replaced:
            if self.router is not None:
                self.router.deregister(old)
                self.router.register(new)
            self.client.replace_engine(old, new)
        for url in engine_urls:
            self.client.mark_up(url)

    def stop(self) -> None:
        """Stop the router (the client's sessions belong to the loops that opened them)."""
        if self.router is not None:
            router, self.router = self.router, None
            router.process.stop()
