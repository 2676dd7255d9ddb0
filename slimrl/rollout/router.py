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

logger = logging.getLogger(__name__)

# Fields an RL client may need that a router could drop; probed at start-up.
PROBED_FIELDS = ("return_routed_experts",)


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

    def deregister(self, worker_url: str) -> None:
        for worker in self.workers():
            if worker["url"] == worker_url:
                requests.delete(f"{self.url}/workers/{worker['id']}", timeout=10)

    def workers(self) -> list[dict]:
        try:
            return requests.get(f"{self.url}/workers", timeout=5).json().get("workers", [])
        except (requests.RequestException, ValueError):
            return []

    def probe_dropped_fields(self, prompt_ids: list[int]) -> set[str]:
        """Send a 1-token generate through the router asking for every probed field; a field whose
        answer is missing was dropped on the way."""
        body = {
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            **dict.fromkeys(PROBED_FIELDS, True),
        }
        meta = requests.post(f"{self.url}/generate", json=body, timeout=60).json().get("meta_info", {})
        answers = {"return_routed_experts": "routed_experts"}
        self.dropped_fields = {f for f in PROBED_FIELDS if meta.get(answers[f]) is None}
        if self.dropped_fields:
            logger.info(
                "router drops %s: such requests are routed by the client", sorted(self.dropped_fields)
            )
        return self.dropped_fields


def launch_router(
    host: str, port: int, model_path: str, policy: str, log_path: Path | None, timeout: float = 60.0
) -> Router:
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
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
    ]
    process = ServerProcess(name="sglang-router", command=cmd, host=host, port=port, log_path=log_path)
    process.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise SlimError(f"sglang-router exited while starting ({process.log_hint()})")
        try:
            if requests.get(f"{process.url}/liveness", timeout=1).status_code == 200:
                return Router(process=process)
        except requests.RequestException:
            pass
        time.sleep(0.2)
    process.stop()
    raise SlimError(f"sglang-router not ready after {timeout:.0f} s ({process.log_hint()})")
