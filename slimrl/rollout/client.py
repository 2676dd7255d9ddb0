"""Async client of the fleet: `/generate` through the router or straight to an engine.

Routing: through sglang-router when there is one and the request needs no field the router drops;
otherwise the client picks the live engine with the fewest requests in flight. A request whose
engine dies is retried on another engine; a request that runs past `request_timeout_s` is aborted
on the engines and reported as `RequestTimedOut` (the rollout turns it into an aborted sample).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from typing import Any

import aiohttp

from slimrl.errors import SlimError

logger = logging.getLogger(__name__)


class RequestTimedOut(Exception):
    """A generate request exceeded its deadline; it has been aborted on the engines."""


class NoEngineAvailable(SlimError):
    """Every engine of the fleet failed the request."""


class FleetClient:
    def __init__(
        self,
        engine_urls: Iterable[str],
        router_url: str | None = None,
        router_dropped_fields: Iterable[str] = (),
        api_key: str | None = None,
        request_timeout_s: float = 300.0,
        max_attempts: int = 4,
    ) -> None:
        self.engines: list[str] = list(engine_urls)
        self.router_url = router_url
        self.router_dropped = set(router_dropped_fields)
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.in_flight: dict[str, int] = dict.fromkeys(self.engines, 0)
        self.down: set[str] = set()
        self.failovers = 0
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    # ------------------------------------------------------------------ fleet membership
    def mark_down(self, url: str) -> None:
        self.down.add(url)

    def mark_up(self, url: str) -> None:
        self.down.discard(url)
        self.in_flight.setdefault(url, 0)

    def replace_engine(self, old: str, new: str) -> None:
        self.engines = [new if u == old else u for u in self.engines]
        self.down.discard(old)
        self.in_flight.pop(old, None)
        self.in_flight.setdefault(new, 0)

    # ------------------------------------------------------------------ sessions
    def _session(self) -> aiohttp.ClientSession:
        loop_id = id(asyncio.get_running_loop())
        session = self._sessions.get(loop_id)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=0)
            session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
            self._sessions[loop_id] = session
        return session

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ------------------------------------------------------------------ generate
    def _pick_engine(self, exclude: set[str]) -> str:
        live = [u for u in self.engines if u not in self.down and u not in exclude]
        if not live:
            raise NoEngineAvailable(f"no live engine left for the request (tried {sorted(exclude)})")
        return min(live, key=lambda u: self.in_flight.get(u, 0))

    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        rid: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """POST /generate; returns SGLang's response dict (single request)."""
        body: dict[str, Any] = {
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        body["rid"] = rid or uuid.uuid4().hex
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        if text is not None:
            body["text"] = text
        body.update(extra)
        use_router = self.router_url is not None and not (
            self.router_dropped & {k for k, v in extra.items() if v}
        )
        try:
            return await asyncio.wait_for(self._generate(body, use_router), timeout=self.request_timeout_s)
        except TimeoutError:
            await self.abort(body["rid"])
            raise RequestTimedOut(f"request {body['rid']} exceeded {self.request_timeout_s:.0f} s") from None

    async def _generate(self, body: dict[str, Any], use_router: bool) -> dict[str, Any]:
        tried: set[str] = set()
        last_error = ""
        for attempt in range(self.max_attempts):
            via_router = use_router and attempt == 0 and bool(set(self.engines) - self.down)
            url = self.router_url if via_router else self._pick_engine(tried)
            assert url is not None
            self.in_flight[url] = self.in_flight.get(url, 0) + 1
            try:
                async with self._session().post(
                    f"{url}/generate", json=body, headers=self._headers()
                ) as resp:
                    if resp.status < 500:
                        payload = await resp.json(content_type=None)
                        if resp.status != 200:
                            message = payload.get("error", payload) if isinstance(payload, dict) else payload
                            raise SlimError(f"/generate rejected by {url}: {resp.status} {message}")
                        return payload
                    last_error = f"HTTP {resp.status}"
            except (
                aiohttp.ClientConnectionError,
                aiohttp.ServerDisconnectedError,
                asyncio.IncompleteReadError,
            ) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self.in_flight[url] -= 1
            if not via_router:
                tried.add(url)
                self.mark_down(url)  # the fleet's health check brings it back after a restart
            self.failovers += 1
            logger.warning("generate failed on %s (%s); retrying elsewhere", url, last_error)
            await asyncio.sleep(0.1 * (attempt + 1))
        raise NoEngineAvailable(f"/generate failed {self.max_attempts} times; last error: {last_error}")

    # ------------------------------------------------------------------ control
    async def abort(self, rid: str | None = None) -> None:
        """Abort by rid (prefix) or everything, on every live engine; failures are ignored."""
        payload = {"rid": rid} if rid else {"abort_all": True}
        await self.control("abort_request", payload, ignore_errors=True)

    async def control(
        self, endpoint: str, payload: dict[str, Any] | None = None, ignore_errors: bool = False
    ) -> list[Any]:
        """POST to every live engine directly (the router does not proxy control calls)."""

        async def one(url: str) -> Any:
            try:
                async with self._session().post(
                    f"{url}/{endpoint}", json=payload or {}, headers=self._headers()
                ) as resp:
                    body = await resp.json(content_type=None)
                    if resp.status != 200 and not ignore_errors:
                        raise SlimError(f"/{endpoint} failed on {url}: {resp.status} {body}")
                    return body
            except aiohttp.ClientError as exc:
                if ignore_errors:
                    return None
                raise SlimError(f"/{endpoint} failed on {url}: {exc}") from None

        return await asyncio.gather(*(one(u) for u in self.engines if u not in self.down))
