"""The real sglang-router in front of the fleet: launch, register workers, probe what it forwards.

sglang-router 0.3.2 re-serialises `/generate` bodies into its own typed request and drops fields
it does not know (e.g. `return_routed_experts`). We probe that once at start-up; requests that need
a dropped field are routed by the client instead (see `FleetClient`). Control calls
(`/abort_request`, weight updates, pause/continue) are not proxied by the router at all and always
go to each engine directly.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from slimrl.errors import SlimError
from slimrl.rollout.servers import ServerProcess
from slimrl.utils.net import free_port

logger = logging.getLogger(__name__)

# Fields an RL client may need that a router could drop; probed at start-up.
PROBED_FIELDS = ("return_routed_experts",)
ANSWERS = {"return_routed_experts": "routed_experts"}
"""Where each probed field's answer shows up in `meta_info`."""


@dataclass
class Router:
    process: ServerProcess
    dropped_fields: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.process.url

    def register(self, worker_url: str, timeout: float = 60.0) -> None:
        """Add a worker (sglang-router 0.3 registers asynchronously) and wait until it is listed healthy."""
        response = requests.post(f"{self.url}/workers", json={"url": worker_url}, timeout=10)
        if response.status_code not in (200, 202):
            raise SlimError(
                f"router refused worker {worker_url}: {response.status_code} {response.text[:200]}"
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(w["url"] == worker_url and w.get("is_healthy", True) for w in self.workers()):
                return
            time.sleep(0.2)
        raise SlimError(f"router did not list worker {worker_url} within {timeout:.0f} s")

    def deregister(self, worker_url: str, timeout: float = 30.0) -> None:
        """Remove a worker (asynchronous in 0.3) and wait until the router no longer lists it."""
        for worker in self.workers():
            if worker["url"] == worker_url:
                requests.delete(f"{self.url}/workers/{worker['id']}", timeout=10)
        deadline = time.monotonic() + timeout
        while any(w["url"] == worker_url for w in self.workers()):
            if time.monotonic() > deadline:
                raise SlimError(f"router still lists worker {worker_url} after {timeout:.0f} s")
            time.sleep(0.1)

    def workers(self) -> list[dict]:
        try:
            return requests.get(f"{self.url}/workers", timeout=5).json().get("workers", [])
        except (requests.RequestException, ValueError):
            return []

    def probe_dropped_fields(self, prompt_ids: list[int], engine_url: str | None = None) -> set[str]:
        """Fields the router loses on the way to the engine.

        Sends a 1-token generate asking for every probed field through the router (and, with
        `engine_url`, straight to that engine): a field answered directly but not via the router
        was dropped. Without `engine_url`, any missing answer counts as dropped.
        """
        body = {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            **dict.fromkeys(PROBED_FIELDS, True),
        }
        # An engine may refuse a field it was not started for (SGLang needs
        # --enable-return-routed-experts): then there is nothing for the router to drop.
        direct = _probe_answers(engine_url, body) if engine_url else set(PROBED_FIELDS)
        via_router = _probe_answers(self.url, body)
        if via_router is None and direct is not None:
            raise SlimError(f"sglang-router at {self.url} failed a 1-token /generate that its engines serve")
        self.dropped_fields = (direct or set()) - (via_router or set())
        if self.dropped_fields:
            logger.info(
                "router drops %s: such requests are routed by the client", sorted(self.dropped_fields)
            )
        return self.dropped_fields


def _probe_answers(url: str, body: dict) -> set[str] | None:
    """The probed fields answered in `url`'s `/generate` response; None if the request failed."""
    try:
        response = requests.post(f"{url}/generate", json=body, timeout=60)
    except requests.RequestException as exc:
        logger.warning("probe /generate on %s failed: %s", url, exc)
        return None
    if response.status_code != 200:
        logger.warning("probe /generate on %s: HTTP %d %s", url, response.status_code, response.text[:200])
        return None
    meta = response.json().get("meta_info", {})
    return {f for f in PROBED_FIELDS if meta.get(ANSWERS[f]) is not None}


def router_command(host: str, port: int, model_path: str, policy: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "slimrl.rollout.router_main",  # sglang-router's own launcher without its SGLang import
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        # A local path: the router loads the tokenizer from it instead of a hub download.
        "--model-path",
        model_path,
        "--tokenizer-path",
        model_path,
        "--log-level",
        "warn",
        "--disable-circuit-breaker",
        "--request-timeout-secs",
        "3600",
        # We restart dead engines ourselves; the router's own retries would duplicate requests.
        "--disable-retries",
        # Its metrics exporter defaults to port 29000 for every router: two runs on a host collide.
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(free_port(host)),
    ]


def start_router(host: str, port: int, model_path: str, policy: str, log_path: Path | None) -> Router:
    """Start the router process without waiting (it comes up while the engines load)."""
    command = router_command(host, port, model_path, policy)
    process = ServerProcess(name="sglang-router", command=command, host=host, port=port, log_path=log_path)
    process.start()
    return Router(process=process)


def wait_router_ready(router: Router, timeout: float = 60.0) -> None:
    """Poll `/liveness`; a router that exits or stays silent is stopped and reported."""
    process = router.process
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise SlimError(f"sglang-router exited while starting ({process.log_hint()})")
        try:
            if requests.get(f"{process.url}/liveness", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    process.stop()
    raise SlimError(f"sglang-router not ready after {timeout:.0f} s ({process.log_hint()})")


def launch_router(
    host: str, port: int, model_path: str, policy: str, log_path: Path | None, timeout: float = 60.0
) -> Router:
    """Start the router and wait until it answers."""
    router = start_router(host, port, model_path, policy, log_path)
    wait_router_ready(router, timeout)
    return router
