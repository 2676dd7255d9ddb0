"""`slimrl serve`: the embedded engine behind SGLang's native HTTP API (aiohttp, one process).

The server listens at once and loads the model in a background thread, so `/health` answers 503
until the engine is ready, as SGLang's does. Request/response JSON follows SGLang (see
the SGLang HTTP API reference, `sglang_http_api.md`); the deliberate differences:

* `/health` is a liveness check (model loaded, scheduler alive); `/health_generate` runs a real
  one-token generation (or answers 200 at once while generation is paused or memory released);
* reply bodies are SGLang's (`tests/test_engine_contract.py` holds both engines to them): empty
  for `/abort_request`, plain text for `/flush_cache`, `null` for memory release/resume,
  `{"message", "status"}` for pause/continue, `{"success", "message"}` for weight updates and
  their sessions; a malformed body is FastAPI's 400 `{"object": "error", "message", ...}`, other
  errors `{"error": {"message"}}`, with one-line messages (SGLang's span several lines);
* there is no prefix cache: `cached_tokens` is 0 and `flush_cache` only checks idleness;
* `init_weights_update_group` supports `backend: "gloo"` only (CPU); ranks join a standalone group
  made by `tensor_transport.init_weight_update_group`, which the trainer side must use as well;
* `version` is slimrl's, `engine` is `slimrl-embedded` and `api_level` names the SGLang contract
  mirrored (0.5.23): no reply or log line of this server passes for SGLang's.

Memory release and resume behave as SGLang's memory saver (see `engine`): released weights are lost
unless the server runs with `--enable-weights-cpu-backup`, and resuming a tag that is not released
stops the scheduler; the server then exits as SGLang's does (the call gets no reply, the log an
error line, the process a non-zero status).

With `--api-key`, every endpoint except generation, health and the read-only info/load endpoints
needs `Authorization: Bearer <key>` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

import slimrl
from slimrl.rollout.embedded import tensor_transport
from slimrl.rollout.embedded.engine import (
    PAUSE_MODES,
    EmbeddedEngine,
    EngineError,
    EngineFatal,
    GenerateRequest,
    RequestError,
)
from slimrl.rollout.embedded.megatron_scorer import MegatronScorer
from slimrl.rollout.embedded.protocol import generate_response, parse_generate
from slimrl.rollout.embedded.sampling import SamplingParams
from slimrl.rollout.embedded.weights import WeightUpdateError
from slimrl.weight_sync.engines import ADMIN_ENDPOINTS

log = logging.getLogger(__name__)
T = TypeVar("T")

SGLANG_API_VERSION = "0.5.23"
"""The SGLang HTTP contract this server follows (`api_level`); its own `version` is slimrl's."""
ENGINE_NAME = "slimrl-embedded"
HEALTH_CHECK_TIMEOUT_S = 20.0
ALWAYS_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Probes answer without a key, as in SGLang (load balancers and Prometheus hold no secrets)."""
SUCCESS_SHAPED = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/begin_weight_update",
        "/end_weight_update",
        "/weights_checker",
    }
)
"""Endpoints whose refusals SGLang answers as `{"success": false, "message"}`."""
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
SESSION_NEEDED = "{} must run between begin_weight_update() and end_weight_update()"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    """SGLang's `--api-key`: every endpoint but the probes needs it (admin ones only without an admin key)."""
    admin_api_key: str | None = None
    """SGLang's `--admin-api-key`: the control endpoints (`ADMIN_ENDPOINTS`) need it, and only it."""
    max_running_requests: int = 64
    seed: int = 0
    weight_version: str = "default"
    group_timeout_s: float = 120.0
    true_on_policy: bool = False
    """Report trainer-identical logprobs (`megatron_scorer.MegatronScorer`)."""
    weights_cpu_backup: bool = False
    """SGLang's `--enable-weights-cpu-backup`: released weights come back on resume (else NaN)."""
    trust_remote_code: bool = False
    """SGLang's `--trust-remote-code`: transformers may run the checkpoint's own tokenizer/model code."""


def request_allowed(path: str, authorization: str | None, args: ServerArgs) -> bool:
    """SGLang 0.5.23's rule for its two keys (checked against SGLang's own decision function in
    `tests/test_engine_auth.py`): probes are open; a control endpoint needs the admin key when
    one is set, else the API key when one is set; any other endpoint needs the API key if set."""
    if path.startswith(ALWAYS_OPEN_PREFIXES):
        return True
    control = path.strip("/") in ADMIN_ENDPOINTS
    key = (args.admin_api_key or args.api_key) if control else args.api_key
    if not key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


class HttpError(Exception):
    """An error answered as JSON with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())


class BadBody(HttpError):
    """A request body that does not fit the endpoint's schema (FastAPI's validation error)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def _error_body(status: int, message: str, path: str, validation: bool) -> dict[str, Any]:
    """SGLang's error shape for this path and kind of error."""
    message = " ".join(str(message).split()) or "error"
    if path == "/generate":
        return {"error": {"message": message, "code": status}}
    if validation:
        return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    if path in SUCCESS_SHAPED:
        return {"success": False, "message": message}
    return {"error": {"message": message}}


def _dumps(value: Any) -> str:
    """JSON as SGLang's orjson writes it: NaN and infinities become null (lost weights give NaN
    logprobs; `json.dumps` would write `NaN`, which is not JSON)."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite_or_null(value), allow_nan=False)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(v) for v in value]
    return value


def _ok(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


async def _in_thread(fn: Callable[[], T]) -> T:
    """Run blocking `fn` in a daemon thread (a hung gloo call must not block interpreter exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:
            loop.call_soon_threadsafe(lambda e=exc: future.done() or future.set_exception(e))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=run, name="slimrl-serve-blocking", daemon=True).start()
    return await future


async def _json_body(request: web.Request, *, required: bool = False) -> dict[str, Any]:
    """The JSON object body; an empty body or `null` is `{}` unless `required`."""
    raw = await request.text()
    if not raw.strip():
        if required:
            raise BadBody("request body is empty; expected a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadBody(f"malformed JSON body: {exc}") from None
    if body is None and not required:
        return {}
    if not isinstance(body, dict):
        raise BadBody(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """`body[key]` checked against `kind` (bool is not an int here); a missing key is `default`."""
    value = body.get(key)
    if value is None:
        if default is ...:
            raise BadBody(f"missing required field `{key}`")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise BadBody(f"field `{key}`: invalid type {type(value).__name__}, expected {expected}")
    return value


class EmbeddedServer:
    """The aiohttp application plus the engine it loads in the background."""

    def __init__(self, args: ServerArgs, engine_factory: Callable[[], EmbeddedEngine] | None = None) -> None:
        self.args = args
        self._engine_factory = engine_factory or self._make_engine
        self.engine: EmbeddedEngine | None = None
        self.load_error: str | None = None
        self.fatal_error: str | None = None
        """Why the scheduler stopped (the server exits with it)."""
        self.ready = asyncio.Event()
        self.stopped = asyncio.Event()
        self.started_at = time.time()
        self._groups: dict[str, tensor_transport.WeightUpdateGroup] = {}
        self._session_open = False
        """SGLang 0.5.23's weight-update session: tensor and distributed loads need one."""
        self._group_lock = asyncio.Lock()
        self.app = self._build_app()

    # ------------------------------------------------------------------ app

    def _make_engine(self) -> EmbeddedEngine:
        rescorer = None
        if self.args.true_on_policy:
            rescorer = MegatronScorer(self.args.model_path, seed=self.args.seed)
        return EmbeddedEngine(
            self.args.model_path,
            max_running_requests=self.args.max_running_requests,
            seed=self.args.seed,
            weight_version=self.args.weight_version,
            rescorer=rescorer,
            weights_cpu_backup=self.args.weights_cpu_backup,
            trust_remote_code=self.args.trust_remote_code,
        )

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._access, self._errors, self._auth], client_max_size=1 << 30)
        routes: list[tuple[tuple[str, ...], str, Handler]] = [
            (("POST", "PUT"), "/generate", self.generate),
            (("GET",), "/health", self.health),
            (("GET",), "/health_generate", self.health_generate),
            (("GET",), "/ping", self.ping),
            (("GET",), "/ready", self.ready_check),
            (("GET", "POST"), "/get_model_info", self.model_info),
            (("GET", "POST"), "/model_info", self.model_info),
            (("GET", "POST"), "/get_server_info", self.server_info),
            (("GET", "POST"), "/server_info", self.server_info),
            (("GET",), "/get_load", self.get_load),
            (("GET",), "/v1/loads", self.v1_loads),
            (("GET", "POST"), "/flush_cache", self.flush_cache),
            (("POST",), "/abort_request", self.abort_request),
            (("POST",), "/pause_generation", self.pause_generation),
            (("POST",), "/continue_generation", self.continue_generation),
            (("GET", "POST"), "/release_memory_occupation", self.release_memory),
            (("GET", "POST"), "/resume_memory_occupation", self.resume_memory),
            (("POST",), "/update_weights_from_disk", self.update_weights_from_disk),
            (("POST",), "/update_weights_from_tensor", self.update_weights_from_tensor),
            (("POST",), "/init_weights_update_group", self.init_weights_update_group),
            (("POST",), "/update_weights_from_distributed", self.update_weights_from_distributed),
            (("POST",), "/destroy_weights_update_group", self.destroy_weights_update_group),
            (("POST",), "/update_weight_version", self.update_weight_version),
            (("GET", "POST"), "/get_weights_by_name", self.get_weights_by_name),
            (("POST",), "/begin_weight_update", self.begin_weight_update),
            (("POST",), "/end_weight_update", self.end_weight_update),
            (("GET", "POST"), "/weights_checker", self.weights_checker),
        ]
        for methods, path, handler in routes:
            for method in methods:
                app.router.add_route(method, path, handler)
        return app

    @staticmethod
    def _is_control(path: str) -> bool:
        return path.strip("/") in ADMIN_ENDPOINTS

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every error becomes JSON in SGLang's shape for the path, with a one-line message."""
        validation = False
        try:
            return await handler(request)
        except EngineFatal:
            # SGLang's server dies without answering: hold the call until the exit drops it.
            await asyncio.Future()
            raise
        except HttpError as exc:
            status, message, validation = exc.status, exc.message, isinstance(exc, BadBody)
        except (RequestError, WeightUpdateError) as exc:
            status, message = 400, str(exc)
        except EngineError as exc:
            status, message = exc.status, str(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            status, message = exc.status, exc.reason
        except Exception as exc:
            log.exception("unhandled error on %s", request.path)
            status, message = 500, f"{type(exc).__name__}: {exc}"
        return web.json_response(_error_body(status, message, request.path, validation), status=status)

    @web.middleware
    async def _access(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """One line per control call, the request part in the shape of SGLang's access log
        (uvicorn), so a test reads the order of calls from either engine's log the same way; the
        line names this engine, so no log of it passes for SGLang's."""
        response = await handler(request)
        if self._is_control(request.path):
            peer = request.remote or "-"
            print(
                f'{ENGINE_NAME}: {peer} - "{request.method} {request.path} HTTP/1.1" {response.status}',
                flush=True,
            )
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request_allowed(request.path, request.headers.get("Authorization"), self.args):
            return web.json_response({"error": "Unauthorized"}, status=401)  # SGLang's body
        return await handler(request)

    def _engine(self) -> EmbeddedEngine:
        if self.engine is None:
            raise HttpError(503, self.load_error or "the model is still loading")
        return self.engine

    @staticmethod
    async def _wait(future: Any) -> Any:
        """Await a scheduler-thread command (`concurrent.futures.Future`)."""
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------ lifecycle

    def load_engine_in_background(self) -> None:
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = self._engine_factory()
            except Exception as exc:
                message = f"cannot load model {self.args.model_path}: {' '.join(str(exc).split())}"
                loop.call_soon_threadsafe(self._load_failed, message)
                return
            loop.call_soon_threadsafe(self._loaded, engine)

        threading.Thread(target=load, name="slimrl-serve-load", daemon=True).start()

    def _loaded(self, engine: EmbeddedEngine) -> None:
        if self.stopped.is_set():
            engine.stop()
            return
        loop = asyncio.get_running_loop()
        engine.on_fatal = lambda exc: loop.call_soon_threadsafe(self._scheduler_died, exc)
        self.engine = engine
        self.ready.set()

    def _scheduler_died(self, exc: EngineFatal) -> None:
        """The scheduler stopped for good: exit, as SGLang's server does when its scheduler dies."""
        self.fatal_error = f"scheduler hit a fatal error: {exc}"
        self.stopped.set()

    def _load_failed(self, message: str) -> None:
        self.load_error = message
        self.stopped.set()

    def shutdown_engine(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        for group in self._groups.values():
            group.destroy()
        self._groups.clear()

    # ------------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.Response:
        engine = self._engine()
        parsed = parse_generate(await _json_body(request, required=True), engine.tokenizer)
        for req in parsed.requests:
            engine.validate(req)
        futures = [engine.submit(req) for req in parsed.requests]
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:  # the client went away: free the engine, as SGLang does
            for req in parsed.requests:
                with contextlib.suppress(EngineError):
                    engine.abort(req.rid)
            raise
        for result in results:
            code = result.finish_reason.get("status_code")
            if result.finish_reason["type"] == "abort" and code is not None and code >= 400:
                raise HttpError(code, result.finish_reason.get("message", "aborted"))
        items = [
            generate_response(result, req, parsed, engine.tokenizer)
            for result, req in zip(results, parsed.requests, strict=True)
        ]
        return web.json_response(items if parsed.is_batch else items[0], dumps=_dumps)

    # ------------------------------------------------------------------ health and info

    async def health(self, request: web.Request) -> web.Response:
        engine = self._engine()
        if not engine.alive:
            raise HttpError(503, "the scheduler thread is not running")
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        engine = self._engine()
        if not engine.alive:
            raise HttpError(503, "the scheduler thread is not running")
        state = engine.load_info()
        if state["paused"] or "kv_cache" in state["released"]:
            return web.Response(status=200)
        probe = GenerateRequest(
            input_ids=[0],
            sampling=SamplingParams(temperature=0.0, max_new_tokens=1),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        )
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit(probe)), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            raise HttpError(503, "health check generation timed out") from None
        return web.Response(status=200)

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready_check(self, request: web.Request) -> web.Response:
        engine = self._engine()
        if engine.load_info()["paused"]:
            raise HttpError(503, "generation is paused")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        engine = self._engine()
        return web.json_response(
            {
                "model_path": engine.model_path,
                "tokenizer_path": engine.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": engine.weight_version,
                "served_model_name": engine.model_path,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(engine.config, "model_type", None),
                "architectures": getattr(engine.config, "architectures", None),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        engine = self._engine()
        state = engine.load_info()
        return web.json_response(
            {
                "model_path": engine.model_path,
                "tokenizer_path": engine.model_path,
                "served_model_name": engine.model_path,
                "host": self.args.host,
                "port": self.args.port,
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "ep_size": 1,
                "nnodes": 1,
                "num_gpus": 0,
                "device": "cpu",
                "dtype": "float32",
                "disaggregation_mode": "null",
                "disaggregation_bootstrap_port": None,
                "encoder_only": False,
                "enable_memory_saver": True,
                "enable_weights_cpu_backup": self.args.weights_cpu_backup,
                "enable_return_routed_experts": engine.is_moe,
                "weight_version": engine.weight_version,
                "random_seed": self.args.seed,
                "true_on_policy": self.args.true_on_policy,
                "max_running_requests": engine.max_running_requests,
                "context_length": engine.context_length,
                "max_req_input_len": engine.context_length - 1,
                "max_total_num_tokens": engine.context_length * engine.max_running_requests,
                "internal_states": [{"num_running_reqs": state["num_running_reqs"]}],
                "version": slimrl.__version__,
                "engine": ENGINE_NAME,
                "api_level": f"sglang {SGLANG_API_VERSION}",
                "startup_time": self.started_at,
                "frontend": "python",
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        state = self._engine().load_info()
        running, waiting = state["num_running_reqs"], state["num_waiting_reqs"]
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": running + waiting,
                    "num_waiting_reqs": waiting,
                    "num_tokens": state["num_used_tokens"],
                }
            ]
        )

    async def v1_loads(self, request: web.Request) -> web.Response:
        engine = self._engine()
        state = engine.load_info()
        total = engine.context_length * engine.max_running_requests
        load = {
            "dp_rank": 0,
            "num_running_reqs": state["num_running_reqs"],
            "num_waiting_reqs": state["num_waiting_reqs"],
            "num_used_tokens": state["num_used_tokens"],
            "num_total_tokens": total,
            "max_total_num_tokens": total,
            "token_usage": state["num_used_tokens"] / total,
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": state["num_running_reqs"] / engine.max_running_requests,
        }
        return web.json_response(
            {
                "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
                "version": slimrl.__version__,
                "accelerator": "cpu",
                "num_accelerators": 0,
                "loads": [load],
            }
        )

    # ------------------------------------------------------------------ scheduling control

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Plain text, as SGLang: 200 when idle, 400 while requests run or wait."""
        engine = self._engine()
        if await self._wait(engine.flush_cache()):
            return web.Response(text=FLUSHED)
        return web.Response(text="Flush cache failed.\n", status=400)

    async def abort_request(self, request: web.Request) -> web.Response:
        """Empty 200 whatever it hit; a rid must be exact (SGLang ignores a prefix)."""
        engine = self._engine()
        body = await _json_body(request)
        rid = _field(body, "rid", str, "")
        abort_all = _field(body, "abort_all", bool, False)
        await self._wait(engine.abort(rid, abort_all, exact=True))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        engine = self._engine()
        mode = _field(await _json_body(request), "mode", str, "abort")
        if mode not in PAUSE_MODES:
            raise BadBody(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
        await self._wait(engine.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        engine = self._engine()
        await _json_body(request)
        await self._wait(engine.continue_generation())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request: web.Request) -> web.Response:
        """Body `null`, as SGLang's handler returns None."""
        engine = self._engine()
        tags = _field(await _json_body(request), "tags", list, None)
        await self._wait(engine.release_memory(tags))
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        engine = self._engine()
        tags = _field(await _json_body(request), "tags", list, None)
        await self._wait(engine.resume_memory(tags))
        return web.json_response(None)

    # ------------------------------------------------------------------ weights

    async def _before_update(self, engine: EmbeddedEngine, body: dict[str, Any]) -> str | None:
        """Common options of the weight-update endpoints; returns the new weight version."""
        if _field(body, "abort_all_requests", bool, False):
            await self._wait(engine.abort(abort_all=True))
        _field(body, "flush_cache", bool, True)
        version = body.get("weight_version")
        return None if version is None else str(version)

    async def _after_update(self, engine: EmbeddedEngine, body: dict[str, Any], version: str | None) -> str:
        """SGLang's ending: the flush (default on) fails the call while requests run or wait,
        though the weights were loaded; otherwise the success message."""
        if _field(body, "flush_cache", bool, True) and not await self._wait(engine.is_idle()):
            raise WeightUpdateError(NOT_FLUSHED)
        suffix = f" Weight version updated to {version}." if version is not None else ""
        return f"Succeeded to update model weights.{suffix}"

    def _require_session(self, endpoint: str) -> None:
        if not self._session_open:
            raise WeightUpdateError(SESSION_NEEDED.format(endpoint))

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """No session needed (SGLang checks one only for tensor and distributed loads)."""
        engine = self._engine()
        body = await _json_body(request, required=True)
        path = _field(body, "model_path", str)
        version = await self._before_update(engine, body)
        try:
            await self._wait(engine.update_weights_from_disk(path, version))
            message = await self._after_update(engine, body, version)
        except WeightUpdateError as exc:
            return web.json_response(
                {"success": False, "message": str(exc), "num_paused_requests": 0}, status=400
            )
        return _ok(message, num_paused_requests=0)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        engine = self._engine()
        body = await _json_body(request, required=True)
        payloads = _field(body, "serialized_named_tensors", list)
        load_format = _field(body, "load_format", str, None)
        if not payloads or not isinstance(payloads[0], str):
            raise BadBody("serialized_named_tensors must be a non-empty list of base64 strings")
        self._require_session("update_weights_from_tensor")
        version = await self._before_update(engine, body)
        # tp_size is 1: this engine's rank reads entry 0, as SGLang's TP rank 0 does.
        try:
            named = await _in_thread(lambda: tensor_transport.decode_update_payload(payloads[0], load_format))
        except ValueError as exc:
            raise HttpError(400, f"serialized_named_tensors[0]: {exc}") from None
        await self._wait(engine.update_weights(named, version))
        del named
        return _ok(await self._after_update(engine, body, version))

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        self._engine()
        body = await _json_body(request, required=True)
        address = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        rank_offset = _field(body, "rank_offset", int)
        world_size = _field(body, "world_size", int)
        name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "gloo")
        if backend != "gloo":
            raise HttpError(400, f"backend `{backend}` is not available on the CPU engine; use gloo")
        if name in self._groups:
            raise HttpError(400, f"weight update group `{name}` already exists; destroy it first")
        try:
            group = await _in_thread(
                lambda: tensor_transport.init_weight_update_group(
                    address, port, rank_offset, world_size, name, self.args.group_timeout_s
                )
            )
        except (ValueError, RuntimeError, OSError) as exc:  # OSError: TimeoutError at a dead address
            raise HttpError(400, f"cannot join weight update group `{name}`: {exc}") from None
        self._groups[name] = group
        return _ok("Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        import torch

        engine = self._engine()
        body = await _json_body(request, required=True)
        names = _field(body, "names", list)
        dtype_names = _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        name = _field(body, "group_name", str, "weight_update_group")
        load_format = _field(body, "load_format", str, None)
        self._require_session("update_weights_from_distributed")
        if not len(names) == len(dtype_names) == len(shapes):
            raise HttpError(400, "names, dtypes and shapes must have the same length")
        dtypes = []
        for dtype_name in dtype_names:
            dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise HttpError(400, f"unknown dtype `{dtype_name}`")
            dtypes.append(dtype)
        if load_format not in (None, "flattened_bucket"):
            raise HttpError(400, f"load_format `{load_format}` is not supported")
        group = self._groups.get(name)
        if group is None:
            raise HttpError(400, f"weight update group `{name}` does not exist")
        version = await self._before_update(engine, body)

        def receive() -> list[tuple[str, Any]]:
            if load_format == "flattened_bucket":
                _, total = tensor_transport.flattened_layout(dtypes, shapes)
                flat = group.broadcast(torch.empty(total, dtype=torch.uint8), src=0)
                return tensor_transport.split_flat_buffer(flat, names, dtypes, shapes)
            return [
                (n, group.broadcast(torch.empty(tuple(s), dtype=d), src=0))
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]

        async with self._group_lock:  # broadcasts of two updates must not interleave
            named = await _in_thread(receive)
        await self._wait(engine.update_weights(named, version))
        return _ok(await self._after_update(engine, body, version))

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = _field(await _json_body(request), "group_name", str, "weight_update_group")
        group = self._groups.pop(name, None)
        if group is None:
            raise HttpError(400, f"weight update group `{name}` does not exist")
        group.destroy()
        return _ok(f"Succeeded to destroy custom process group `{name}`.")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        engine = self._engine()
        body = await _json_body(request, required=True)
        version = str(_field(body, "new_version", (str, int)))
        if _field(body, "abort_all_requests", bool, True):
            await self._wait(engine.abort(abort_all=True))
        await self._wait(engine.set_weight_version(version))
        return _ok(f"Weight version updated to {version}", new_version=version)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        engine = self._engine()
        body = await _json_body(request) if request.method == "POST" else dict(request.query)
        name = _field(body, "name", str)
        raw = body.get("truncate_size", 100)
        if isinstance(raw, str) and raw.isdigit():  # a GET query carries strings
            raw = int(raw)
        size = _field({"truncate_size": raw}, "truncate_size", int)
        values = await self._wait(engine.get_weights_by_name(name, size))
        return web.json_response(values, dumps=_dumps)

    async def weights_checker(self, request: web.Request) -> web.Response:
        """SGLang's weight checker: `{"success", "message"}`, with `ranks` (one per TP rank) and
        `per_engine_checksum` (SHA-256 over the ranks' checksums) for `checksum`."""
        engine = self._engine()
        body = await _json_body(request)
        action = _field(body, "action", str, "checksum")
        _field(body, "allow_quant_error", bool, False)  # nothing is quantised here
        skip = _field(body, "skip_tensor_list", list, None)
        rank = await self._wait(engine.check_weights(action, skip))
        if rank is None:
            return _ok("Success.")
        overall = hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
        return _ok("Success.", ranks=[rank], per_engine_checksum=overall)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """Open SGLang 0.5.23's session (nothing to restore here: no in-place quantisation)."""
        self._engine()
        selector = _field(await _json_body(request), "selector", str, "all")
        if selector not in ("target", "draft", "all"):
            raise BadBody(f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}")
        if self._session_open:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        self._session_open = True
        return _ok("Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        self._engine()
        await _json_body(request)
        if not self._session_open:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        self._session_open = False
        return _ok("Success")


def keep_alive_seconds() -> float:
    """How long an idle keep-alive connection stays open: SGLang's (uvicorn's
    `timeout_keep_alive`, `SGLANG_TIMEOUT_KEEP_ALIVE`, 5 s) rather than aiohttp's hour, so a
    client that reuses a connection the server already closed fails here as against SGLang."""
    return float(os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", "5"))


class _GrpcProbeFilter(logging.Filter):
    """sglang-router (0.3.x) probes every worker it registers for gRPC as well as HTTP
    (`detect_connection_mode`): an HTTP/2 preface on the HTTP port, which aiohttp answers with a
    400 and logs at ERROR with a traceback ("Pause on PRI/Upgrade"). The probe is expected (real
    SGLang's uvicorn refuses it the same way) and says nothing about the engine: drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc))


def quiet_grpc_probes() -> None:
    """Keep the router's gRPC probes out of the engine's log (idempotent)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _GrpcProbeFilter) for f in logger.filters):
        logger.addFilter(_GrpcProbeFilter())


async def serve(args: ServerArgs, on_ready: Callable[[str], None] | None = None) -> None:
    """Listen, load, announce readiness, and run until SIGTERM/SIGINT (then shut down cleanly)."""
    server = EmbeddedServer(args)
    quiet_grpc_probes()
    runner = web.AppRunner(
        server.app, handle_signals=False, access_log=None, shutdown_timeout=3.0,
        keepalive_timeout=keep_alive_seconds(),
    )  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise EngineError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stopped.set)
    server.load_engine_in_background()
    try:
        ready = asyncio.ensure_future(server.ready.wait())
        stopped = asyncio.ensure_future(server.stopped.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if server.ready.is_set() and not server.stopped.is_set() and on_ready is not None:
            on_ready(f"http://{args.host}:{args.port}")
        await stopped
        ready.cancel()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        server.shutdown_engine()
        await runner.cleanup()
    if server.load_error or server.fatal_error:
        raise EngineError(server.load_error or server.fatal_error)


def run(args: ServerArgs, on_ready: Callable[[str], None] | None = None) -> None:
    """Blocking entry point for the CLI."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(max(int(threads), 1))
    asyncio.run(serve(args, on_ready))


__all__ = ["EmbeddedServer", "ServerArgs", "run", "serve"]
