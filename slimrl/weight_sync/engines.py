"""The control calls a weight sync makes on each engine, parsed as SGLang 0.5.23 answers them.

Every call is bounded by `timeout_s`; a refusal (non-200, or `success: false`) is one line naming
the engine and SGLang's message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from slimrl.errors import SlimError

ADMIN_ENDPOINTS = frozenset(
    {
        "flush_cache", "abort_request", "pause_generation", "continue_generation",
        "release_memory_occupation", "resume_memory_occupation", "update_weights_from_disk",
        "update_weights_from_tensor", "update_weights_from_distributed", "init_weights_update_group",
        "destroy_weights_update_group", "update_weight_version", "get_weights_by_name",
        "begin_weight_update", "end_weight_update", "weights_checker",
    }
)  # fmt: skip
"""SGLang 0.5.23's admin-level endpoints among those slimrl calls or serves: with an admin key
set they need it (and refuse the plain API key); every other endpoint needs the plain key, if any.
`tests/test_engine_auth.py` checks the set against SGLang's own route decorators."""


def auth_header(endpoint: str, api_key: str | None, admin_api_key: str | None) -> dict[str, str]:
    """The `Authorization` header SGLang wants for `endpoint` from a client holding both keys."""
    admin = endpoint.strip("/") in ADMIN_ENDPOINTS
    key = (admin_api_key or api_key) if admin else api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True, slots=True)
class Engine:
    """One rollout server as a weight sync sees it."""

    url: str
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class EngineCalls:
    """POSTs to engines with the run's keys and a bound on every wait."""

    api_key: str | None = None
    admin_api_key: str | None = None
    timeout_s: float = 600.0

    def post(self, url: str, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        headers = auth_header(endpoint, self.api_key, self.admin_api_key)
        try:
            reply = requests.post(
                f"{url}/{endpoint}", json=body or {}, headers=headers, timeout=self.timeout_s
            )
        except requests.RequestException as exc:
            raise SlimError(f"weight sync: /{endpoint} on {url}: {type(exc).__name__}: {exc}") from None
        parsed = _parse(reply.text)
        refused = isinstance(parsed, dict) and parsed.get("success") is False
        if reply.status_code != 200 or refused:
            raise SlimError(
                f"weight sync: /{endpoint} refused by {url}: {_message(reply.status_code, parsed)}"
            )
        return parsed

    def each(
        self, pool: ThreadPoolExecutor, engines: Sequence[Engine], call: Callable[[Engine], Any]
    ) -> list:
        return list(pool.map(call, engines))

    def begin(self, pool: ThreadPoolExecutor, engines: Sequence[Engine]) -> None:
        self.each(pool, engines, lambda e: self.post(e.url, "begin_weight_update"))


def _parse(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text  # SGLang answers /flush_cache in plain text


def _message(status: int, parsed: Any) -> str:
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        parsed = inner.get("message", inner) if isinstance(inner, dict) else inner
    return f"HTTP {status}: {' '.join(str(parsed).split())[:400] or '(empty body)'}"
