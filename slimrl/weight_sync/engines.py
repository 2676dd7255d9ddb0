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


@dataclass(frozen=True, slots=True)
class Engine:
    """One rollout server as a weight sync sees it."""

    url: str
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class EngineCalls:
    """POSTs to engines with the run's API key and a bound on every wait."""

    api_key: str | None = None
    timeout_s: float = 600.0

    def post(self, url: str, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
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
