"""Async client of the fleet: `/generate` through the router or straight to an engine.

Routing: through sglang-router when there is one, no engine is known to be down and the request
needs no field the router drops; otherwise the client picks the live engine with the fewest
requests in flight. A request whose engine dies (connection error or 5xx) is retried on another
engine; a request that runs past `request_timeout_s` is aborted on the engines and reported as
`RequestTimedOut` (the rollout turns it into an aborted sample). A 4xx is the request's own fault:
it raises a one-line `SlimError` at once, without retries.

Request ids: a request without an explicit `rid` gets `<rid_prefix><uuid>`, where the prefix comes
from the `RID_PREFIX` context variable. The rollout sets it per rollout, so aborting that prefix
also stops the requests of custom `generate()` hooks, which never see rids.

Aborts: SGLang's `/abort_request` needs the exact rid (its tokenizer manager silently ignores a
rid it does not know, such as a prefix), so the client remembers every rid in flight and where
it went; `abort(prefix)` sends each matching rid to the engine that has it (to every engine when
the router chose). Replies are parsed as SGLang shapes them: JSON, plain text or an empty body.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import uuid
from collections.abc import Iterable
from typing import Any

import aiohttp

from slimrl.errors import SlimError
from slimrl.weight_sync.engines import auth_header, parse_body, reply_message

logger = logging.getLogger(__name__)

RID_PREFIX: contextvars.ContextVar[str] = contextvars.ContextVar("slimrl_rid_prefix", default="")
"""Prefix of generated rids in the current task (set by the rollout, inherited by hooks)."""

ABORT_TIMEOUT_S = 10.0
ABORT_CONCURRENCY = 64
"""Abort calls in flight at once (one per rid and engine)."""
POOL_KEEP_ALIVE_S = 2.0
"""An idle pooled connection is reused only this long. SGLang's server closes one idle for 5 s
(uvicorn's `timeout_keep_alive`, `SGLANG_TIMEOUT_KEEP_ALIVE`), aiohttp's pool keeps one for 15:
after a pause between 5 and 15 s (a weight sync on a loaded host) a request could go out on a
connection the engine was closing, fail with "Can not write request body", and take the live
engine for dead. Well under 5 s, the close can never race the reuse."""
_UNREACHABLE = "unreachable"
_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.IncompleteReadError)


class RequestTimedOut(Exception):
    """A generate request exceeded its deadline; it has been aborted on the engines."""


class NoEngineAvailable(SlimError):
    """Every engine of the fleet failed the request."""


class FleetDown(NoEngineAvailable):
    """Every engine is marked down: no request can be served until the driver heals the fleet, so
    a rollout stops at once instead of failing each of its samples in turn."""


def error_message(status: int, text: str) -> str:
    """One line out of an error body (`engines.reply_message`), with its HTTP status."""
    return f"HTTP {status}: {reply_message(parse_body(text))[:500] or '(empty body)'}"


def parse_reply(text: str) -> Any:
    """A 200 body as SGLang sends it: JSON (`{"success", "message"}` for weight updates,
    `{"message", "status"}` for pause/continue, `null` for memory calls), plain text
    (`/flush_cache`) or nothing (`/abort_request`, which gives None)."""
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


class FleetClient:
    def __init__(
        self,
        engine_urls: Iterable[str],
        router_url: str | None = None,
        router_dropped_fields: Iterable[str] = (),
        api_key: str | None = None,
        admin_api_key: str | None = None,
        request_timeout_s: float = 300.0,
        max_attempts: int = 4,
    ) -> None:
        self.engines: list[str] = list(engine_urls)
        self.router_url = router_url
        self.router_dropped = set(router_dropped_fields)
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.in_flight: dict[str, int] = dict.fromkeys(self.engines, 0)
        self.down: set[str] = set()
        self.failovers = 0
        self.router_down = False
        """Set when the router stops accepting connections: every request is routed client-side."""
        self.requests_via_router = 0
        self.requests_direct = 0
        self.rids: dict[str, str | None] = {}
        """rid -> engine it was last sent to (None: through the router), while in flight."""
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    # ------------------------------------------------------------------ fleet membership
    def mark_down(self, url: str) -> None:
        if url in self.engines and url not in self.down:
            logger.warning("engine %s marked down; routing around it until it is healed", url)
        self.down.add(url)

    def mark_up(self, url: str) -> None:
        self.down.discard(url)
        self.in_flight.setdefault(url, 0)

    def replace_engine(self, old: str, new: str) -> None:
        self.engines = [new if u == old else u for u in self.engines]
        self.down.discard(old)
        self.in_flight.pop(old, None)
        self.in_flight.setdefault(new, 0)

    def live_engines(self) -> list[str]:
        return [u for u in self.engines if u not in self.down]

    # ------------------------------------------------------------------ sessions
    def _session(self) -> aiohttp.ClientSession:
        """One session per event loop: an aiohttp session must not outlive or cross its loop."""
        loop = asyncio.get_running_loop()
        for old_loop in [lp for lp in self._sessions if lp.is_closed()]:
            del self._sessions[old_loop]  # its connections died with the loop
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=POOL_KEEP_ALIVE_S)
            session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
            self._sessions[loop] = session
        return session

    async def close(self) -> None:
        """Close this loop's session (sessions of other, still running loops are theirs to close)."""
        loop = asyncio.get_running_loop()
        session = self._sessions.pop(loop, None)
        if session is not None:
            await session.close()

    def _headers(self, endpoint: str) -> dict[str, str]:
        return auth_header(endpoint, self.api_key, self.admin_api_key)

    # ------------------------------------------------------------------ generate
    def _pick_engine(self, exclude: set[str]) -> str:
        up = self.live_engines()
        if not up:
            raise FleetDown(f"every engine is down ({', '.join(self.engines)}): none left to generate on")
        live = [u for u in up if u not in exclude]
        if not live:
            raise NoEngineAvailable(f"no live engine left for the request (tried {sorted(exclude)})")
        return min(live, key=lambda u: self.in_flight.get(u, 0))

    def needs_client_routing(self, fields: dict[str, Any]) -> bool:
        """True when a request sets a field the router would drop on the way."""
        return any(fields.get(name) for name in self.router_dropped)

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
            "rid": rid or f"{RID_PREFIX.get()}{uuid.uuid4().hex}",
        }
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        if text is not None:
            body["text"] = text
        body.update(extra)
        use_router = self.router_url is not None and not self.needs_client_routing(extra)
        return await self._within_timeout(body, [body["rid"]], use_router, f"request {body['rid']}")

    async def _within_timeout(
        self, body: dict[str, Any], rids: list[str], use_router: bool, what: str
    ) -> Any:
        """`_generate` with its rids known while in flight; past `request_timeout_s` every one of
        them is aborted on the engines and `RequestTimedOut` raised."""
        self.rids.update(dict.fromkeys(rids))
        try:
            return await asyncio.wait_for(self._generate(body, use_router), timeout=self.request_timeout_s)
        except TimeoutError:
            await self._abort_rids(rids)
            raise RequestTimedOut(
                f"{what} exceeded rollout.request_timeout_s={self.request_timeout_s:g}"
            ) from None
        finally:
            for rid in rids:
                self.rids.pop(rid, None)

    async def generate_batch(
        self,
        *,
        input_ids: list[list[int]],
        sampling_params: list[dict[str, Any]],
        rids: list[str],
        return_logprob: bool = False,
        **extra: Any,
    ) -> list[dict[str, Any]]:
        """POST one batched /generate (SGLang's list form: one prompt, sampling parameters and rid
        per item; `extra` fields apply to every item) to one engine; returns one response per item,
        in order. Routed by the client: sglang-router refuses per-item sampling parameters. A
        timeout aborts every item; a dead engine's batch is retried whole on another."""
        if not (len(input_ids) == len(sampling_params) == len(rids) > 0):
            raise ValueError("generate_batch: one prompt, sampling parameters and rid per item")
        body: dict[str, Any] = {
            "input_ids": [list(ids) for ids in input_ids],
            "sampling_params": [dict(p) for p in sampling_params],
            "return_logprob": return_logprob,
            "rid": list(rids),
            **extra,
        }
        result = await self._within_timeout(body, list(rids), False, f"batch {rids[0]} (+{len(rids) - 1})")
        if not (isinstance(result, list) and len(result) == len(rids)):
            raise SlimError(f"/generate answered a batch of {len(rids)} with {str(result)[:200]}")
        return result

    async def _generate(self, body: dict[str, Any], use_router: bool) -> Any:
        tried: set[str] = set()
        last_error = ""
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        for attempt in range(self.max_attempts):
            # The router knows nothing of engines we saw die: while one is down, route ourselves.
            via_router = use_router and attempt == 0 and not self.down and not self.router_down
            url = self.router_url if via_router else self._pick_engine(tried)
            assert url is not None
            self.rids.update(dict.fromkeys(rids, None if via_router else url))
            result, last_error = await self._post_generate(url, body)
            if via_router and result is None and last_error.startswith(_UNREACHABLE):
                logger.error("router %s unreachable (%s); routing client-side from now on", url, last_error)
                self.router_down = True
            if result is not None:
                if via_router:
                    self.requests_via_router += 1
                else:
                    self.requests_direct += 1
                return result
            if not via_router:
                tried.add(url)
                self.mark_down(url)  # Fleet.heal() restarts it and swaps it back in
            self.failovers += 1
            logger.warning("generate failed on %s (%s); retrying elsewhere", url, last_error)
            await asyncio.sleep(0.1 * (attempt + 1))
        raise NoEngineAvailable(f"/generate failed {self.max_attempts} times; last error: {last_error}")

    async def _post_generate(self, url: str, body: dict[str, Any]) -> tuple[Any, str]:
        """(response, "") on success, (None, reason) on a retryable failure; raises on a 4xx."""
        items = len(body["rid"]) if isinstance(body["rid"], list) else 1  # a batch weighs its items
        self.in_flight[url] = self.in_flight.get(url, 0) + items
        try:
            async with self._session().post(
                f"{url}/generate", json=body, headers=self._headers("generate")
            ) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    return None, error_message(resp.status, text)
                if resp.status != 200:
                    raise SlimError(f"/generate rejected by {url}: {error_message(resp.status, text)}")
                try:
                    return json.loads(text), ""
                except ValueError:
                    return None, f"malformed JSON answer: {text[:200]!r}"
        except aiohttp.ClientConnectorError as exc:  # nothing listens there
            return None, f"{_UNREACHABLE}: {exc}"
        except _RETRYABLE as exc:
            return None, f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight[url] -= items

    # ------------------------------------------------------------------ control
    async def abort(self, prefix: str | None = None) -> None:
        """Abort this client's requests whose rid starts with `prefix` (each by its exact rid), or
        with no prefix everything on every live engine. Failures are ignored, and a hung engine
        cannot stall the caller (shutdown aborts must not hang)."""
        if not prefix:
            await self.control(
                "abort_request", {"abort_all": True}, ignore_errors=True, timeout_s=ABORT_TIMEOUT_S
            )
            return
        await self._abort_rids([rid for rid in list(self.rids) if rid.startswith(prefix)])

    async def _abort_rids(self, rids: list[str]) -> None:
        """One exact-rid `/abort_request` per rid, to its engine or, if unknown, to every engine."""
        gate = asyncio.Semaphore(ABORT_CONCURRENCY)
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)

        async def one(url: str, rid: str) -> None:
            async with gate:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self._session().post(
                        f"{url}/abort_request",
                        json={"rid": rid},
                        headers=self._headers("abort_request"),
                        timeout=timeout,
                    ) as resp:
                        await resp.read()

        calls = []
        for rid in rids:
            engine = self.rids.get(rid)
            targets = [engine] if engine in self.live_engines() else self.live_engines()
            calls.extend(one(url, rid) for url in targets)
        await asyncio.gather(*calls)

    async def control(
        self,
        endpoint: str,
        payload: dict[str, Any] | None = None,
        ignore_errors: bool = False,
        timeout_s: float | None = None,
        urls: list[str] | None = None,
    ) -> list[Any]:
        """POST to every live engine (or the live ones of `urls`) directly (the router does not
        proxy control calls)."""
        return await self._fan_out("POST", endpoint, payload or {}, ignore_errors, timeout_s, urls)

    async def query(self, endpoint: str, timeout_s: float | None = 60.0) -> list[Any]:
        """GET a read-only endpoint (`get_model_info`, `v1/loads`, ...) of every live engine."""
        return await self._fan_out("GET", endpoint, None, False, timeout_s)

    async def _fan_out(
        self,
        method: str,
        endpoint: str,
        payload: dict[str, Any] | None,
        ignore_errors: bool,
        timeout_s: float | None,
        urls: list[str] | None = None,
    ) -> list[Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)

        async def one(url: str) -> Any:
            try:
                async with self._session().request(
                    method,
                    f"{url}/{endpoint}",
                    json=payload,
                    headers=self._headers(endpoint),
                    timeout=timeout,
                ) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        if ignore_errors:
                            return None
                        raise SlimError(f"/{endpoint} failed on {url}: {error_message(resp.status, text)}")
                    return parse_reply(text)
            except aiohttp.ClientConnectionError as exc:
                # The process is gone (refused/dropped connection): route around it until
                # Fleet.heal() restarts it; a control call must not end the run.
                logger.warning("/%s: %s unreachable (%s)", endpoint, url, type(exc).__name__)
                self.mark_down(url)
                return None
            except (aiohttp.ClientError, TimeoutError) as exc:
                if ignore_errors:
                    return None
                raise SlimError(f"/{endpoint} failed on {url}: {type(exc).__name__}: {exc}") from None

        targets = [u for u in self.live_engines() if urls is None or u in urls]
        return await asyncio.gather(*(one(u) for u in targets))
