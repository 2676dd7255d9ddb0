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
class EngineAddress:
    """One rollout server as a weight sync sees it."""

    url: str
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class Reply:
    """One engine's answer: `ok` is HTTP 200 without `success: false`; `body` parsed JSON or text."""

    url: str
    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return self.status == 200 and not (isinstance(self.body, dict) and self.body.get("success") is False)

    @property
    def message(self) -> str:
        """SGLang's message in one line (`message`, or `error.message`, else the whole body)."""
        return reply_message(self.body)


@dataclass(frozen=True, slots=True)
class EngineCalls:
    """Calls to engines with the run's keys and a bound on every wait; `who` names the caller in
    a transport failure (the sync, the update check)."""

    api_key: str | None = None
    admin_api_key: str | None = None
    timeout_s: float = 600.0
    who: str = "weight sync"

    def call(
        self, url: str, endpoint: str, body: dict[str, Any] | None = None, *, get: bool = False
    ) -> Reply:
        """One bounded request; a refusal is returned (`Reply.ok`), an unreachable engine raises."""
        headers = auth_header(endpoint, self.api_key, self.admin_api_key)
        try:
            if get:
                reply = requests.get(f"{url}/{endpoint}", headers=headers, timeout=self.timeout_s)
            else:
                reply = requests.post(
                    f"{url}/{endpoint}", json=body or {}, headers=headers, timeout=self.timeout_s
                )
        except requests.RequestException as exc:
            raise SlimError(f"{self.who}: /{endpoint} on {url}: {type(exc).__name__}: {exc}") from None
        return Reply(url, reply.status_code, parse_body(reply.text))

    def post(self, url: str, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        """`call`, with a refusal raised as one line naming the engine and SGLang's message."""
        reply = self.call(url, endpoint, body)
        if not reply.ok:
            said = reply.message[:400] or "(empty body)"
            raise SlimError(f"{self.who}: /{endpoint} refused by {url}: HTTP {reply.status}: {said}")
        return reply.body

    def each(
        self, pool: ThreadPoolExecutor, engines: Sequence[EngineAddress], call: Callable[[EngineAddress], Any]
    ) -> list:
        return list(pool.map(call, engines))

    def begin(self, pool: ThreadPoolExecutor, engines: Sequence[EngineAddress]) -> None:
        self.each(pool, engines, lambda e: self.post(e.url, "begin_weight_update"))


def parse_body(text: str) -> Any:
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text  # SGLang answers /flush_cache in plain text


def reply_message(body: Any) -> str:
    """An engine's error message in one line, whole (a `compare` failure lists every tensor):
    SGLang's `{"error": {"message"}}`, `{"error": str}`, `{"message"}` (FastAPI validation, weight
    updates), `{"detail"}` (FastAPI's 404/405) or plain text."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        body = inner.get("message", inner.get("detail", inner)) if isinstance(inner, dict) else inner
    return " ".join(str(body if body is not None else "").split())
