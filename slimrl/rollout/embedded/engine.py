"""The embedded engine: a transformers causal LM behind a continuous-batching scheduler (CPU).

One dedicated thread owns the model. Each scheduler step

1. runs queued control commands (abort, pause, weight loads, ...): they always execute *between*
   forwards, so a weight update never races a forward;
2. admits waiting requests up to `max_running_requests`: new ones share left-padded prefill
   forwards (those needing per-prompt-token outputs, or resuming, are prefilled alone), their first
   tokens are sampled from the prefill logits, and the caches are merged into the running batch
   (`kv_cache.BatchKV`, left padding + attention mask + explicit position ids);
3. runs ONE batched decode forward for every running request, samples one token per request
   (`sampling.sample_step`) and retires finished requests at once (their rows leave the cache).

A request's result therefore depends only on its own prompt, parameters and seed: greedy outputs
equal a one-request-at-a-time decode token for token (batched and single forwards differ only by
float rounding, ~1e-6 in logprobs), and seeded sampling draws from a per-request generator.
Logprobs are read from the distribution each token was sampled from (see `sampling`). With a
`rescorer`, a finished request's `output_token_logprobs` are replaced by its answer (computed on
the scheduler thread, only for requests that asked for logprobs), and the largest difference to the
decode-time logprobs is reported as `decode_logprob_max_abs_diff`. A rescorer with
`wants_temperature = True` also receives the request's effective temperature; one with a
`refresh(targets)` method is called after every weight update (`megatron_scorer.MegatronScorer`:
trainer-identical logprobs for true on-policy RL).

Weight updates run between two steps without waiting for in-flight requests to drain (SGLang
waits unless paused): running requests continue under the new weights with their old KV cache,
exactly like SGLang's `in_place` pause. Pause first (`abort` or `retract`) for clean boundaries.

Routed experts (MoE): a forward pre-hook on every fused-experts module records the `top_k_index`
its router chose, so a request gets one [moe_layers, top_k] row per token that went through the
model: prompt + generated - 1 rows (the last sampled token is never fed), like SGLang's
`routed_experts`. Rows are per MoE layer (all layers for Qwen3-MoE).

Pause modes follow SGLang: "abort" aborts everything in flight; "in_place" freezes the running
batch with its KV cache; "retract" drops the KV caches and puts the requests back in the queue,
to be re-prefilled (prompt + tokens so far) after `continue`, so they resume under the weights
current at that time.

Releasing memory behaves as SGLang's memory saver on a GPU (its CPU stand-in,
`slimrl/compat/sglang_cpu/memory_saver.py`, is the referee): releasing `kv_cache` drops the KV
caches and refuses new generation until resumed; releasing `weights` loses them (every parameter
becomes NaN; buffers survive, as SGLang stashes and restores its buffers) unless the engine keeps a
host backup (`weights_cpu_backup`, SGLang's `--enable-weights-cpu-backup`), copied back on resume:
without it the weights must be loaded again after the resume. A rescorer with `refresh` follows the
live weights through both, so it cannot keep a good copy that hides lost weights. Resuming a tag
that is not released is fatal (`EngineFatal`): the scheduler stops, as SGLang's scheduler dies on
its `KeyError`, and the server exits, so a caller that gets the order wrong finds out.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from slimrl.data.hf_tokenizer import load_tokenizer
from slimrl.rollout.embedded.kv_cache import BatchKV
from slimrl.rollout.embedded.sampling import SamplingParams, sample_step
from slimrl.rollout.embedded.weight_checker import WeightChecker
from slimrl.rollout.embedded.weights import WeightTargets, load_checkpoint
from slimrl.utils.hf import quiet_progress_bars

log = logging.getLogger(__name__)

T = TypeVar("T")
Rescorer = Callable[..., list[float]]
"""(prompt + response token ids, response length[, temperature]) -> one logprob per response token."""
SampleObserver = Callable[[str, torch.Tensor, int, float], None]
"""(rid, the [V] log-distribution sampled from, token, reported logprob): a test/debug hook."""

PAUSE_MODES = ("abort", "retract", "in_place")
PREFILL_TOKEN_BUDGET = 8192
"""Padded tokens per batched prefill forward (bounds its activation memory)."""
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
DECODE_CACHE_MAX_TOKENS = 4
DECODE_CACHE_SIZE = 65536
"""Decoded texts of outputs up to DECODE_CACHE_MAX_TOKENS tokens kept (cleared when full)."""


class EngineError(Exception):
    """Base class; `status` is the HTTP status the server answers with."""

    status = 500


class RequestError(EngineError, ValueError):
    """The request itself is invalid (bad ids, too long, unsupported option)."""

    status = 400


class EngineBusy(EngineError):
    """The operation needs an idle engine."""

    status = 400


class EngineUnavailable(EngineError):
    """Generation is refused right now (memory released, shutting down)."""

    status = 503


class EngineFatal(EngineError):
    """The scheduler cannot go on and stops (SGLang's scheduler process dies the same way); the
    command that hit it fails with this, and `EmbeddedEngine.on_fatal` is told."""


def abort_reason(message: str = "Aborted", status_code: int | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


@dataclass(kw_only=True)
class GenerateRequest:
    """One prompt to complete (SGLang's `GenerateReqInput` for a single item, already parsed)."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    top_logprobs_num: int = 0
    """The k most likely tokens and their logprobs at every output position (SGLang's
    `output_top_logprobs`), from the same distribution as `output_token_logprobs`."""


@dataclass(kw_only=True)
class GenerateResult:
    """Everything the server needs for SGLang's response shape."""

    rid: str
    prompt_ids: list[int]
    generated_ids: list[int]
    """Every sampled token; `output_token_logprobs` aligns with these."""
    output_ids: list[int]
    """SGLang's `output_ids`: every generated token, a matched stop token included even without
    `no_stop_trim` (which only keeps the stop in `text`)."""
    text: str
    finish_reason: dict[str, Any]
    output_token_logprobs: list[float]
    input_token_logprobs: list[float | None] | None
    """For prompt positions `logprob_start_len..` (first entry None, as SGLang); None if not asked."""
    input_token_ids: list[int]
    routed_experts: torch.Tensor | None
    """int32 [prompt + generated - 1 - start, moe_layers, top_k] when asked."""
    weight_version: str
    e2e_latency: float
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    """SGLang's `meta_info.weight_versions`: `{version, start, end}` spans of the output tokens."""
    num_retractions: int = 0
    decode_logprob_max_abs_diff: float | None = None
    """With a rescorer: max |decode-time logprob - rescored logprob| over the response."""
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    """Per output token, `top_logprobs_num` (logprob, id) pairs, most likely first; None if not asked
    (decode-time values, also with a rescorer)."""

    @property
    def completion_tokens(self) -> int:
        return len(self.generated_ids)


@dataclass(eq=False)
class _Req:
    """Scheduler-side state of one request."""

    spec: GenerateRequest
    future: Future
    generator: torch.Generator
    max_new: int
    arrival: float
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    routing: list[torch.Tensor] = field(default_factory=list)
    retractions: int = 0
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """(version before an update, tokens generated under it): SGLang's `WeightVersionEvent`."""

    @property
    def rid(self) -> str:
        return self.spec.rid

    @property
    def params(self) -> SamplingParams:
        return self.spec.sampling


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' fused-experts modules, in layer order (their forward gets `top_k_index`)."""
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "gate_up_proj", None)
        if name.endswith(".experts") and isinstance(weight, torch.nn.Parameter) and weight.dim() == 3:
            found.append(module)
    return found


class EmbeddedEngine:
    """Load `model_path` and serve generation requests from a scheduler thread.

    Thread-safe API: `submit` / `generate` for requests; `abort`, `pause`, `continue_generation`,
    `flush_cache`, `release_memory`, `resume_memory`, `update_weights`, `update_weights_from_disk`
    for control: each runs on the scheduler thread between two steps and returns a
    `concurrent.futures.Future` of its result (exceptions included).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_running_requests: int = 64,
        seed: int = 0,
        rescorer: Rescorer | None = None,
        weight_version: str = "default",
        on_sample: SampleObserver | None = None,
        weights_cpu_backup: bool = False,
        trust_remote_code: bool = False,
        start: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        self.model_path = str(model_path)
        self.tokenizer_path = self.model_path
        """Stays the launch path when weights come from elsewhere (SGLang keeps it too)."""
        with quiet_progress_bars():
            remote = trust_remote_code  # `model.trust_remote_code`, as `slimrl serve --trust-remote-code`
            self.tokenizer = load_tokenizer(self.model_path, remote)
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=torch.float32, attn_implementation="sdpa", trust_remote_code=remote
            )
        self.model = model.eval().requires_grad_(False)
        self.config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = frozenset(
            _token_ids(getattr(self.model.generation_config, "eos_token_id", None))
            | _token_ids(getattr(self.config, "eos_token_id", None))
            | _token_ids(self.tokenizer.eos_token_id)
        )
        self.targets = WeightTargets(self.model)
        self.checker = WeightChecker(self.model)
        self.max_running_requests = max_running_requests
        self.rescorer = rescorer
        self.on_sample = on_sample
        self.weight_version = weight_version
        self.steps = 0
        """Scheduler steps run so far (tests use it to stagger arrivals)."""
        self._decoded: dict[tuple[tuple[int, ...], bool], str] = {}

        self._experts = _expert_modules(self.model)
        self.top_k_experts = int(getattr(self.config, "num_experts_per_tok", 0) or 0)
        self._routing: list[torch.Tensor | None] | None = None
        for layer, module in enumerate(self._experts):
            module.register_forward_pre_hook(self._routing_hook(layer), with_kwargs=True)

        self._seed_rng = random.Random(seed)
        self._cv = threading.Condition()
        self._incoming: deque[_Req] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._stopping = False
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._kv = BatchKV()
        self._paused: str | None = None
        self._released: set[str] = set()
        self.weights_cpu_backup = weights_cpu_backup
        self._weights_backup: list[torch.Tensor] | None = None
        self.fatal: EngineFatal | None = None
        """Why the scheduler stopped, if it hit a fatal error."""
        self.on_fatal: Callable[[EngineFatal], None] | None = None
        """Called on the scheduler thread once it has stopped for a fatal error (the server exits)."""
        self._thread = threading.Thread(target=self._loop, name="slimrl-engine-scheduler", daemon=True)
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (their callers get partial results) and end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def is_moe(self) -> bool:
        return bool(self._experts)

    @property
    def num_moe_layers(self) -> int:
        return len(self._experts)

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerateRequest) -> Future[GenerateResult]:
        """Queue a request; the future resolves when it finishes (stop, length or abort)."""
        self.validate(request)
        if "kv_cache" in self._released:
            raise EngineUnavailable("memory is released; call resume_memory_occupation before generating")
        future: Future[GenerateResult] = Future()
        with self._cv:
            if self._stopping:
                raise EngineUnavailable("the engine is shutting down")
            seed = request.sampling.sampling_seed
            if seed is None:
                seed = self._seed_rng.randrange(1 << 63)
            generator = torch.Generator().manual_seed(int(seed) & ((1 << 64) - 1))
            max_new = request.sampling.max_new_tokens
            req = _Req(
                spec=request, future=future, generator=generator, max_new=max_new, arrival=time.monotonic()
            )
            self._incoming.append(req)
            self._cv.notify_all()
        return future

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self.submit(request).result(timeout)

    def validate(self, request: GenerateRequest) -> None:
        """Raise RequestError if `submit` would refuse this request."""
        ids = request.input_ids
        if not ids:
            raise RequestError("input_ids is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise RequestError(
                f"the input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)"
            )
        total = len(ids) + request.sampling.max_new_tokens
        if total > self.context_length:  # SGLang refuses rather than truncating
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of {total} tokens: {len(ids)} "
                f"tokens from the input messages and {request.sampling.max_new_tokens} tokens for the "
                "completion."
            )
        if request.return_routed_experts and not self.is_moe:
            raise RequestError("return_routed_experts: the model has no routed experts")
        if not 0 <= request.routed_experts_start_len <= len(ids):
            raise RequestError(f"routed_experts_start_len must be in [0, {len(ids)}]")
        try:
            request.sampling.validate()
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    # ------------------------------------------------------------------ control (scheduler thread)

    def call_async(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the scheduler thread between two steps."""
        future: Future[T] = Future()
        with self._cv:
            if self._stopping or (not self._thread.is_alive() and self._thread.ident is not None):
                future.set_exception(EngineUnavailable("the engine is shutting down"))
                return future
            self._commands.append((fn, future))
            self._cv.notify_all()
        return future

    def abort(self, rid: str | None = None, abort_all: bool = False, exact: bool = False) -> Future[int]:
        """Abort requests whose rid starts with `rid` (or all); resolves to how many.

        With `exact`, nothing happens unless a live request has exactly this rid, as behind
        SGLang's HTTP API: its tokenizer manager ignores a rid it does not know (a prefix), and
        only then does its scheduler abort by prefix."""
        return self.call_async(lambda: self._abort(rid, abort_all, exact=exact))

    def pause(self, mode: str = "abort") -> Future[None]:
        return self.call_async(lambda: self._pause(mode))

    def continue_generation(self) -> Future[None]:
        return self.call_async(self._continue)

    def flush_cache(self) -> Future[bool]:
        """True when idle (there is no prefix cache to flush); False while requests hold KV."""
        return self.call_async(self._flush_cache)

    def release_memory(self, tags: Iterable[str] | None = None) -> Future[None]:
        return self.call_async(lambda: self._release(tags))

    def resume_memory(self, tags: Iterable[str] | None = None) -> Future[None]:
        return self.call_async(lambda: self._resume(tags))

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> Future[int]:
        """Load HF-named tensors into the live model between steps; see `weights.WeightTargets`."""
        items = list(named_tensors)
        return self.call_async(lambda: self._load(lambda: self.targets.load(items), weight_version))

    def update_weights_from_disk(
        self, model_path: str | Path, weight_version: str | None = None
    ) -> Future[int]:
        """Load a checkpoint directory; `model_path` then names it, as SGLang's `/get_model_info`."""

        def load() -> int:
            count = load_checkpoint(self.targets, model_path)
            self.model_path = str(model_path)
            return count

        return self.call_async(lambda: self._load(load, weight_version))

    def set_weight_version(self, version: str) -> Future[None]:
        return self.call_async(lambda: self._set_weight_version(str(version)))

    def is_idle(self) -> Future[bool]:
        """No request running or queued (SGLang's `is_fully_idle`, which a cache flush needs)."""
        return self.call_async(lambda: not self._busy())

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Future[list[float]]:
        return self.call_async(lambda: self.targets.get(name).detach().reshape(-1)[:truncate_size].tolist())

    def check_weights(self, action: str, skip: list[str] | None = None) -> Future[dict[str, Any] | None]:
        """SGLang's `/weights_checker` actions on the served weights (`weight_checker.py`)."""

        def run() -> dict[str, Any] | None:
            result = self.checker.handle(action, skip)
            if action == "reset_tensors":
                self._refresh_rescorer()
            return result

        return self.call_async(run)

    def load_info(self) -> dict[str, Any]:
        """Counts for /get_load and /v1/loads (read without locking: approximate by nature)."""
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting) + len(self._incoming),
            "num_used_tokens": self._kv.num_tokens(),
            "paused": self._paused,
            "released": sorted(self._released),
        }

    # ------------------------------------------------------------------ command bodies

    def _live(self) -> list[_Req]:
        return [*self._running, *self._waiting, *self._incoming]

    def _abort(self, rid: str | None, abort_all: bool, message: str = "Aborted", exact: bool = False) -> int:
        if not abort_all and not rid:
            return 0
        if exact and not abort_all and all(req.rid != rid for req in self._live()):
            return 0

        def hit(req: _Req) -> bool:
            return abort_all or req.rid.startswith(rid or "")

        count = 0
        kept_waiting: deque[_Req] = deque()
        for req in self._waiting:
            if hit(req):
                self._finish(req, abort_reason(message))
                count += 1
            else:
                kept_waiting.append(req)
        self._waiting = kept_waiting
        keep = []
        for row, req in enumerate(self._running):
            if hit(req):
                self._finish(req, abort_reason(message))
                count += 1
            else:
                keep.append(row)
        self._retire(keep)
        return count

    def _pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if mode == "abort":
            self._abort(None, True)
        elif mode == "retract":
            for req in reversed(self._running):
                req.retractions += 1
                self._waiting.appendleft(req)
            self._running = []
            self._kv.clear()
        self._paused = mode

    def _continue(self) -> None:
        self._paused = None

    def _busy(self) -> bool:
        return bool(self._running) or (self._paused is None and bool(self._waiting))

    def _flush_cache(self) -> bool:
        return not self._busy()

    def _release(self, tags: Iterable[str] | None) -> None:
        tags = self._check_tags(tags)
        if self._running or self._waiting:
            raise EngineBusy(
                f"cannot release memory with {len(self._running) + len(self._waiting)} request(s) in flight"
            )
        self._kv.clear()
        if "weights" in tags and "weights" not in self._released:
            self._lose_weights()
        self._released |= tags

    def _resume(self, tags: Iterable[str] | None) -> None:
        order = list(tags or MEMORY_TAGS)
        chosen = self._check_tags(order)
        for tag in order:  # SGLang: `offload_tags.remove(tag)` for each, in the caller's order
            if tag not in self._released:
                raise EngineFatal(
                    f"resume_memory_occupation: memory tag {tag!r} is not released (SGLang's "
                    f"scheduler dies here on KeyError: {tag!r})"
                )
        if "weights" in chosen and self._weights_backup is not None:
            with torch.no_grad():
                for param, saved in zip(self._served_parameters(), self._weights_backup, strict=True):
                    param.copy_(saved)
            self._weights_backup = None
            self._refresh_rescorer()
        self._released -= chosen

    def _served_parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())  # tied ones once

    def _lose_weights(self) -> None:
        """What SGLang's memory saver does to released weights: back them up if asked, then NaN
        (on a GPU the memory is unmapped and comes back undefined)."""
        with torch.no_grad():
            params = self._served_parameters()
            if self.weights_cpu_backup:
                self._weights_backup = [p.detach().clone() for p in params]
            for param in params:
                param.fill_(float("nan"))
        self._refresh_rescorer()

    def _refresh_rescorer(self) -> None:
        """The rescorer's copy follows the live weights (lost ones too: it must not hide a loss)."""
        refresh = getattr(self.rescorer, "refresh", None)
        if refresh is not None:
            refresh(self.targets)

    @staticmethod
    def _check_tags(tags: Iterable[str] | None) -> set[str]:
        chosen = set(tags or MEMORY_TAGS)
        unknown = chosen - set(MEMORY_TAGS)
        if unknown:
            raise RequestError(f"unknown memory tag(s) {sorted(unknown)}; valid: {', '.join(MEMORY_TAGS)}")
        return chosen

    def _load(self, load: Callable[[], int], weight_version: str | None) -> int:
        if "weights" in self._released:  # with SGLang's memory saver the bytes would land nowhere
            raise EngineBusy("weights are released; resume_memory_occupation with tags [weights] first")
        count = load()
        self._refresh_rescorer()
        if weight_version is not None:
            self._set_weight_version(str(weight_version))
        return count

    def _set_weight_version(self, version: str) -> None:
        """Record where each live request's output changes version (SGLang's span events)."""
        if version == self.weight_version:
            return
        for req in self._live():
            if req.output:
                req.version_events.append((self.weight_version, len(req.output)))
        self.weight_version = version

    def _version_spans(self, req: _Req) -> list[dict[str, Any]]:
        """SGLang's `compute_weight_version_spans`: one span per version, covering the output."""
        total = len(req.output)
        spans: list[dict[str, Any]] = []
        for version, end in [*req.version_events, (self.weight_version, total)]:
            end = min(end, total)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and version == spans[-1]["version"]:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return spans

    # ------------------------------------------------------------------ scheduler loop

    def _can_step(self) -> bool:
        return (
            self._paused is None and "kv_cache" not in self._released and bool(self._waiting or self._running)
        )

    def _loop(self) -> None:
        with torch.no_grad():
            try:
                while True:
                    with self._cv:
                        while not (self._stopping or self._commands or self._incoming or self._can_step()):
                            self._cv.wait()
                        if self._stopping:
                            break
                        commands = list(self._commands)
                        self._commands.clear()
                        self._waiting.extend(self._incoming)
                        self._incoming.clear()
                    for index, (fn, future) in enumerate(commands):
                        self._run_command(fn, future)
                        if self.fatal is not None:  # the rest fail in _shutdown
                            with self._cv:
                                self._commands.extendleft(reversed(commands[index + 1 :]))
                            break
                    if self.fatal is not None:
                        log.error("scheduler hit a fatal error, stopping: %s", self.fatal)
                        break
                    if self._can_step():
                        self._step()
            finally:
                self._shutdown()
        if self.fatal is not None and self.on_fatal is not None:
            self.on_fatal(self.fatal)

    def _run_command(self, fn: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except EngineFatal as exc:
            self.fatal = exc
            future.set_exception(exc)
        except BaseException as exc:
            future.set_exception(exc)

    def _shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            commands = list(self._commands)
            self._commands.clear()
        for req in [*self._running, *self._waiting]:
            self._finish(req, abort_reason("The server is shutting down", 503))
        self._running, self._waiting = [], deque()
        self._kv.clear()
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable("the engine is shutting down"))

    def _step(self) -> None:
        try:
            batch: list[_Req] = []
            while self._waiting and len(self._running) + len(batch) < self.max_running_requests:
                req = self._waiting.popleft()
                if self._batchable(req):
                    batch.append(req)
                    continue
                try:
                    self._prefill(req)
                except Exception as exc:
                    self._fail(req, exc)
            for chunk in self._chunks(batch):
                try:
                    self._prefill_together(chunk)
                except Exception as exc:
                    for req in chunk:
                        self._fail(req, exc)
            if self._running:
                self._decode()
        except Exception as exc:
            running, self._running = self._running, []
            self._kv.clear()
            for req in running:
                self._fail(req, exc)
        self.steps += 1

    def _fail(self, req: _Req, exc: Exception) -> None:
        log.error("request %s failed: %s", req.rid, "".join(traceback.format_exception(exc)))
        if not req.future.done():
            req.future.set_exception(EngineError(f"request {req.rid} failed: {' '.join(str(exc).split())}"))

    # ------------------------------------------------------------------ forwards

    def _routing_hook(self, layer: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self._routing is not None:
                index = args[1] if len(args) > 1 else kwargs["top_k_index"]
                self._routing[layer] = index.detach().to(torch.int32).clone()

        return hook

    def _forward(self, want_routing: bool, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, V] and, if asked, routing [B*T, moe_layers, top_k] of one forward."""
        self._routing = [None] * len(self._experts) if want_routing and self._experts else None
        try:
            out = self.model(**inputs, use_cache=True)
            routing = torch.stack(self._routing, dim=1) if self._routing is not None else None  # type: ignore[arg-type]
        finally:
            self._routing = None
        return out.logits.float(), routing

    def _prefill(self, req: _Req) -> None:
        from transformers import DynamicCache

        resumed = bool(req.output)
        tokens = req.spec.input_ids + req.output[:-1]
        want_input_lp = req.spec.return_logprob and req.spec.logprob_start_len >= 0 and not resumed
        cache = DynamicCache()
        logits, routing = self._forward(
            req.spec.return_routed_experts,
            input_ids=torch.tensor([tokens], dtype=torch.long),
            past_key_values=cache,
            logits_to_keep=0 if want_input_lp else 1,
        )
        if routing is not None:
            req.routing = [routing]  # a re-prefill recomputes every row: keep what the model now saw
        if want_input_lp:
            req.input_logprobs = self._input_logprobs(req, logits[0])
        if resumed:
            self._join(req, cache)
            return
        if req.max_new == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        sample = sample_step(logits[0, -1:], [req.params], [req.generator], [self._suppressed(req)])
        self._accept(req, sample.tokens[0], sample.logprobs[0], sample.distributions[0])
        reason = self._finish_reason(req)
        if reason is not None:
            self._finish(req, reason)
        else:
            self._join(req, cache)

    def _batchable(self, req: _Req) -> bool:
        """New requests that need nothing per prompt token share one prefill forward."""
        spec = req.spec
        wants_input_lp = spec.return_logprob and spec.logprob_start_len >= 0
        return not req.output and req.max_new > 0 and not wants_input_lp and not spec.return_routed_experts

    @staticmethod
    def _chunks(batch: list[_Req]) -> Iterator[list[_Req]]:
        """Prefill groups of similar prompt lengths, each within PREFILL_TOKEN_BUDGET padded tokens."""
        batch = sorted(batch, key=lambda r: len(r.spec.input_ids))
        chunk: list[_Req] = []
        for req in batch:
            width = len(req.spec.input_ids)  # sorted: the newest is the longest
            if chunk and width * (len(chunk) + 1) > PREFILL_TOKEN_BUDGET:
                yield chunk
                chunk = []
            chunk.append(req)
        if chunk:
            yield chunk

    def _prefill_together(self, reqs: list[_Req]) -> None:
        from transformers import DynamicCache

        if len(reqs) == 1:
            self._prefill(reqs[0])
            return
        width = max(len(r.spec.input_ids) for r in reqs)
        pads = [width - len(r.spec.input_ids) for r in reqs]
        ids = torch.tensor([[0] * pad + r.spec.input_ids for r, pad in zip(reqs, pads, strict=True)])
        mask = torch.ones_like(ids)
        for row, pad in enumerate(pads):
            mask[row, :pad] = 0
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits, _ = self._forward(
            False,
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            logits_to_keep=1,
        )
        keep = self._sample_next(reqs, logits[:, -1])
        if not keep:
            return
        if len(keep) < len(reqs):
            index = torch.tensor(keep, dtype=torch.long)
            for layer in cache.layers:
                layer.keys, layer.values = (
                    layer.keys.index_select(0, index),
                    layer.values.index_select(0, index),
                )
        self._running.extend(reqs[row] for row in keep)
        self._kv.add(cache, [pads[row] for row in keep])

    def _input_logprobs(self, req: _Req, logits: torch.Tensor) -> list[float | None]:
        prompt = req.spec.input_ids
        start = min(req.spec.logprob_start_len, len(prompt) - 1)
        scaled = logits[start : len(prompt) - 1] / req.params.effective_temperature
        dist = torch.log_softmax(scaled, dim=-1)
        targets = torch.tensor(prompt[start + 1 :], dtype=torch.long)
        values = dist.gather(1, targets[:, None])[:, 0].tolist() if len(targets) else []
        return [None, *values]

    def _join(self, req: _Req, cache: Any) -> None:
        self._running.append(req)
        self._kv.add(cache)

    def _decode(self) -> None:
        running = self._running
        logits, routing = self._forward(
            any(r.spec.return_routed_experts for r in running),
            input_ids=torch.tensor([[r.output[-1]] for r in running], dtype=torch.long),
            attention_mask=self._kv.attention_mask(),
            position_ids=self._kv.position_ids(),
            past_key_values=self._kv.cache,
        )
        self._kv.grew()
        if routing is not None:
            for row, req in enumerate(running):
                if req.spec.return_routed_experts:
                    req.routing.append(routing[row : row + 1])
        self._retire(self._sample_next(running, logits[:, -1]))

    def _sample_next(self, reqs: list[_Req], logits: torch.Tensor) -> list[int]:
        """Sample one token per row of `logits` [B, V]; finish the requests that are done.
        Returns the rows that go on."""
        sample = sample_step(
            logits,
            [r.params for r in reqs],
            [r.generator for r in reqs],
            [self._suppressed(r) for r in reqs],
        )
        keep = []
        for row, req in enumerate(reqs):
            self._accept(req, sample.tokens[row], sample.logprobs[row], sample.distributions[row])
            reason = self._finish_reason(req)
            if reason is None:
                keep.append(row)
            else:
                self._finish(req, reason)
        return keep

    def _retire(self, keep: list[int]) -> None:
        """Keep only the running rows `keep` (finished/aborted rows leave the batch now)."""
        if len(keep) != len(self._running):
            self._running = [self._running[row] for row in keep]
            self._kv.keep(keep)

    # ------------------------------------------------------------------ per-request bookkeeping

    def _suppressed(self, req: _Req) -> tuple[int, ...]:
        p = req.params
        if p.ignore_eos or len(req.output) >= p.min_new_tokens:
            return ()
        return tuple(sorted(self.eos_token_ids | set(p.stop_token_ids)))

    def _accept(self, req: _Req, token: int, logprob: float, dist: torch.Tensor) -> None:
        req.output.append(token)
        req.logprobs.append(logprob)
        if req.spec.top_logprobs_num:
            values, ids = torch.topk(dist, min(req.spec.top_logprobs_num, dist.shape[-1]))
            req.top_logprobs.append(list(zip(values.tolist(), ids.tolist(), strict=True)))
        if self.on_sample is not None:
            self.on_sample(req.rid, dist, token, logprob)

    def _finish_reason(self, req: _Req) -> dict[str, Any] | None:
        """SGLang's order: length first, then stop tokens, then stop strings."""
        p, n = req.params, len(req.output)
        if n >= req.max_new:
            return {"type": "length", "length": n}
        if n < p.min_new_tokens:
            return None
        token = req.output[-1]
        if not p.ignore_eos and (token in self.eos_token_ids or token in p.stop_token_ids):
            return {"type": "stop", "matched": token}
        if p.stop:
            window = max(len(s) for s in p.stop) + 1
            tail = self.tokenizer.decode(req.output[-window:], skip_special_tokens=p.skip_special_tokens)
            for stop in p.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def _finish(self, req: _Req, reason: dict[str, Any]) -> None:
        if req.future.done():
            return
        try:
            result = self._result(req, reason)
        except Exception as exc:
            self._fail(req, exc)
            return
        req.future.set_result(result)

    def _result(self, req: _Req, reason: dict[str, Any]) -> GenerateResult:
        p, spec = req.params, req.spec
        generated = list(req.output)
        matched = reason.get("matched")
        trim = reason["type"] == "stop" and not p.no_stop_trim
        # SGLang keeps a matched stop token in `output_ids` either way; only the text drops it.
        shown = generated[:-1] if trim and isinstance(matched, int) and generated else generated
        text = self._decode_text(shown, p.skip_special_tokens)
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.find(matched)]
        logprobs = list(req.logprobs)
        decode_diff = None
        if self.rescorer is not None and spec.return_logprob and generated:
            logprobs = self._rescore(spec.input_ids + generated, len(generated), p.effective_temperature)
            decode_diff = max(abs(a - b) for a, b in zip(req.logprobs, logprobs, strict=True))
        return GenerateResult(
            rid=req.rid,
            prompt_ids=list(spec.input_ids),
            generated_ids=generated,
            output_ids=generated,
            text=text,
            finish_reason=reason,
            output_token_logprobs=logprobs,
            input_token_logprobs=req.input_logprobs,
            input_token_ids=spec.input_ids[max(min(spec.logprob_start_len, len(spec.input_ids) - 1), 0) :],
            routed_experts=self._routed_rows(req) if spec.return_routed_experts else None,
            weight_version=self.weight_version,
            weight_versions=self._version_spans(req),
            e2e_latency=time.monotonic() - req.arrival,
            num_retractions=req.retractions,
            decode_logprob_max_abs_diff=decode_diff,
            output_top_logprobs=list(req.top_logprobs) if spec.top_logprobs_num else None,
        )

    def _decode_text(self, ids: list[int], skip_special_tokens: bool) -> str:
        """`tokenizer.decode`, memoised for short outputs (RL answers of a token or a few repeat
        thousands of times per rollout, and each decode costs as much as sampling the token)."""
        if len(ids) > DECODE_CACHE_MAX_TOKENS:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        key = (tuple(ids), skip_special_tokens)
        text = self._decoded.get(key)
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            if len(self._decoded) >= DECODE_CACHE_SIZE:
                self._decoded.clear()
            self._decoded[key] = text
        return text

    def _rescore(self, tokens: list[int], response_length: int, temperature: float) -> list[float]:
        assert self.rescorer is not None
        if getattr(self.rescorer, "wants_temperature", False):
            values = self.rescorer(tokens, response_length, temperature)
        else:
            values = self.rescorer(tokens, response_length)
        if len(values) != response_length:
            raise EngineError(f"rescorer returned {len(values)} logprobs for {response_length} tokens")
        return [float(x) for x in values]

    def _routed_rows(self, req: _Req) -> torch.Tensor:
        """Rows for positions start .. seq_len-2: every token that went through the model."""
        shape = (0, self.num_moe_layers, self.top_k_experts)
        rows = torch.cat(req.routing) if req.routing else torch.zeros(shape, dtype=torch.int32)
        seq_len = len(req.spec.input_ids) + len(req.output)
        return rows[req.spec.routed_experts_start_len : max(seq_len - 1, 0)].contiguous()
