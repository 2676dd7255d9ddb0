"""The OpenAI-compatible endpoint slimrl serves in front of the fleet, one session per agent run.

    POST {base_url}/chat/completions      POST {base_url}/completions      GET {base_url}/models
    base_url = http://<host>:<port>/sessions/<session id>/v1

`host`: 127.0.0.1, or the node's cluster address (`rollout.agent_endpoint_host: node`) for agents
that pass `base_url` and the key on to another host; one address either way, never every interface.

Every request needs `Authorization: Bearer <key>`, the key the endpoint drew at start (one per
run): a wrong or missing key is 401, an unknown or closed session 404, a malformed request 400,
all in OpenAI's error shape. Any `model` name is accepted and echoed back.

A chat request's messages go through the chat template once, here (`chat.py`: a continued
conversation reuses the ids already sampled); the prompt goes to the engines' `/generate` as
`input_ids` with `return_logprob` (and the routed experts under routing replay), one request per
choice; `usage` counts exactly the ids fed and returned. Every answer is recorded as a `Turn`.

**Sampling.** A session samples with the sampling parameters it was opened with (the rollout's
`rollout.sampling`, and its seed per call and choice): the policy trained is the one the trainer's
logprobs assume. The agent's `temperature`, `top_p` and `seed` are checked and recorded in the
session, not applied. `max_tokens` and `stop` are the agent's (a stop string stays in the tokens,
as sampled, and leaves the returned text, as OpenAI's); a call never runs past the model's context
or `train.max_seq_len` (a prompt already there is OpenAI's 400 `context_length_exceeded`).

**When a call fails.** A request past `rollout.request_timeout_s`, no engine left, or the rollout
aborting the session's requests ends the session: the call gets a 503, later calls a 404, and the
agent's sample is aborted (timeout, abort) or failed. A fleet that is down altogether is kept to
stop the whole rollout (`Session.fatal`). An engine's 4xx answer is the request's fault: a 400 to the
agent, and the session goes on.

**Parked sessions** (partial rollout). A session the rollout parks at its end (`Session.park`)
holds its calls instead of ending: a call its rollout aborts keeps what it sampled, and a call
made while parked waits before reaching an engine; to the agent, a slow reply. Resumed by the next
rollout (`Session.resume`, under that rollout's request ids), each held call goes on: an aborted
one from its prompt + the ids already sampled (routing rows from its last token on when it holds
the rows of every token it fed), and returns one completion, one turn (`trajectory.joined`) whose
tokens carry the weight versions that sampled them. A held call whose agent hung up is dropped.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from slimrl.errors import SlimError
from slimrl.rollout.agent import openai_api as api
from slimrl.rollout.agent.chat import ChatFormat, message_key, normalize_messages, tools_key
from slimrl.rollout.agent.openai_api import ApiError
from slimrl.rollout.agent.trajectory import Turn, joined, turn_from_response
from slimrl.rollout.client import FleetClient, FleetDown, NoEngineAvailable, RequestTimedOut
from slimrl.rollout.routing import RoutingLayout
from slimrl.sample import Status
from slimrl.utils.net import listening_socket

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SEED_STRIDE = 1_000_003
"""A session's call c, choice i samples with seed `base + SEED_STRIDE * (c * MAX_N + i)`."""


@dataclass
class _Reply:
    """What one turn told the agent, to know it again when the agent sends it back."""

    kind: str
    """`chat` or `completion`."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    tools: str = ""
    reply: str = ""
    """`message_key` of the assistant message returned (chat); the text fed and returned (completion)."""


@dataclass(frozen=True)
class _EngineCall:
    """One choice of one call, as its engine requests are made (again, after a park)."""

    request: web.Request
    session: Session
    call: int
    choice: int
    sampling: dict[str, Any]
    top_logprobs: int | None


def _ended_error(reason: str) -> ApiError:
    return ApiError(503, f"The session ended: {reason}", type="server_error", code="session_ended")


def _holds_rows(session: Session, turn: Turn) -> bool:
    """Whether an aborted turn's routed experts cover every token it fed (not so when it was
    aborted before its prefill ran): then a continuation asks only for the rows after them."""
    layout = session.routing
    if layout is None or turn.routing is None or not turn.completion_ids:
        return False
    rows = len(turn.ids) - 1 - turn.routing_start
    return layout.fits(len(base64.b64decode(turn.routing)) // 4, rows)


@dataclass
class Session:
    id: str
    sampling: dict[str, Any]
    """`/generate` sampling parameters every call starts from."""
    rid_prefix: str
    """Of every engine request the session makes; a resumed session takes the new rollout's."""
    routing: RoutingLayout | None = None
    """Ask the engines for routed experts (routing replay), of this layout."""
    max_seq_len: int | None = None
    turns: list[Turn] = field(default_factory=list)
    replies: list[_Reply] = field(default_factory=list)
    """One per turn, same order (`record` appends both)."""
    calls: int = 0
    continued: set[tuple[int, int]] = field(default_factory=set)
    """(call, choice) of turns a later call's prompt was built on."""
    requested: list[dict[str, Any]] = field(default_factory=list)
    """Sampling values the agent asked for and did not get (per call that asked)."""
    models: set[str] = field(default_factory=set)
    status: Status | None = None
    """Set when the session ended before the agent did: aborted or failed."""
    reason: str = ""
    fatal: BaseException | None = None
    """An error that must stop the whole rollout (every engine down)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    parked: bool = False
    """Held between rollouts (partial rollout): no call reaches an engine until `resume`."""
    parks: int = 0
    in_flight: int = 0
    """Engine requests of the session not answered yet."""
    running: asyncio.Event = field(default_factory=asyncio.Event)
    """Set unless parked: held calls wait on it."""
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once parked with no request at an engine: the rollout may end."""

    def __post_init__(self) -> None:
        self.running.set()

    def record(self, turn: Turn, reply: _Reply) -> None:
        self.turns.append(turn)
        self.replies.append(reply)

    def end(self, status: Status, reason: str, fatal: BaseException | None = None) -> None:
        if self.status is None:
            self.status, self.reason = status, reason
        self.fatal = self.fatal or fatal
        self.ended.set()
        self.running.set()  # held calls wake up and answer that the session ended

    def park(self) -> None:
        """Hold the session's calls: those in flight are aborted by the rollout and kept."""
        if not self.parked:
            self.parked, self.parks = True, self.parks + 1
            self.running.clear()
            self._settle()

    def resume(self, rid_prefix: str) -> None:
        """Release the held calls, their engine requests under `rid_prefix` from now on."""
        self.rid_prefix, self.parked = rid_prefix, False
        self.settled.clear()
        self.running.set()

    def sent(self, change: int) -> None:
        """An engine request went out (+1) or came back (-1)."""
        self.in_flight += change
        self._settle()

    def _settle(self) -> None:
        if self.parked and not self.in_flight:
            self.settled.set()


class AgentEndpoint:
    """The server: start it in the event loop that runs the rollout, open a session per agent run."""

    def __init__(
        self,
        tokenizer: Any,
        client: FleetClient,
        *,
        tool_call_parser: str = "qwen25",
        context_length: int | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.chat = ChatFormat(tokenizer, tool_call_parser)
        self.tokenizer = tokenizer
        self.client = client
        self.context_length = context_length
        self.host = host
        self.api_key = secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self.closed: dict[str, str] = {}
        """Closed session id -> why (a 404 says it)."""
        self.url = ""
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> AgentEndpoint:
        app = web.Application(middlewares=[self._errors])
        v1 = "/sessions/{session}/v1"
        app.router.add_post(f"{v1}/chat/completions", self.chat_completions)
        app.router.add_post(f"{v1}/completions", self.completions)
        app.router.add_get(f"{v1}/models", self.models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = listening_socket(self.host)
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://{self.host}:{sock.getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(
        self,
        sampling: dict[str, Any],
        rid_prefix: str | None = None,
        routing: RoutingLayout | None = None,
        max_seq_len: int | None = None,
    ) -> Session:
        sid = uuid.uuid4().hex
        session = Session(sid, dict(sampling), rid_prefix or f"agent-{sid[:12]}-", routing, max_seq_len)
        self.sessions[sid] = session
        return session

    def base_url(self, session: Session) -> str:
        return f"{self.url}/sessions/{session.id}/v1"

    def close_session(self, session: Session, reason: str = "the agent run ended") -> None:
        """Later calls get a 404 naming `reason`; calls in flight finish (abort them by the prefix)."""
        if self.sessions.pop(session.id, None) is not None:
            self.closed[session.id] = reason

    # ---------------------------------------------------------------- HTTP
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", code=None)
            return web.json_response(error.body(), status=exc.status)

    def _session(self, request: web.Request) -> Session:
        header = request.headers.get("Authorization", "")
        if not header:
            raise ApiError(401, "You didn't provide an API key (Authorization: Bearer <key>).")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        sid = request.match_info["session"]
        session = self.sessions.get(sid)
        if session is None:
            why = self.closed.get(sid)
            message = f"Session {sid} has ended: {why}." if why else f"Session {sid} does not exist."
            raise ApiError(404, message, code="session_not_found")
        return session

    @staticmethod
    async def _body(request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except ValueError:
            raise ApiError(400, "The request body is not valid JSON.", code="invalid_json") from None

    async def models(self, request: web.Request) -> web.Response:
        session = self._session(request)
        names = sorted(session.models) or ["slimrl-policy"]
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "slimrl"} for name in names]
        return web.json_response({"object": "list", "data": data})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        req = api.parse_chat(await self._body(request))
        messages = normalize_messages(req.messages)
        tools = self.chat.tools(req.tools)
        keys = [message_key(m) for m in messages]
        tkey = tools_key(req.tools)
        prompt, parent = self._chat_prompt(session, messages, keys, req.tools, tkey)
        turns = await self._generate(request, session, req, prompt, parent)
        choices, completion_tokens = [], 0
        for turn in turns:
            text, finish = self._text(turn)
            content, calls = text, []
            if req.tools and req.tool_choice != "none":
                content, calls, turn.malformed_tool_call = self.chat.parse_tool_calls(text, tools)
            if calls and finish == "stop":
                finish = "tool_calls"
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = calls
            echoed = normalize_messages([{**message, "content": content or ""}])[0]
            session.record(turn, _Reply("chat", messages, keys, tkey, message_key(echoed)))
            logprobs = (
                None if req.top_logprobs is None else {"content": self._logprobs(turn), "refusal": None}
            )
            choices.append(
                {"index": turn.choice, "message": message, "logprobs": logprobs, "finish_reason": finish}
            )
            completion_tokens += len(turn.completion_ids)
        reply = api.chat_completion(req.model, choices, api.usage(len(prompt), completion_tokens))
        if req.stream:
            return await self._stream(request, api.chat_stream(reply, req.include_usage))
        return web.json_response(reply)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        req = api.parse_completion(await self._body(request))
        prompt, parent, prompt_text = self._completion_prompt(session, req.prompt)
        turns = await self._generate(request, session, req, prompt, parent)
        choices, completion_tokens = [], 0
        for turn in turns:
            text, finish = self._text(turn)
            full = self.tokenizer.decode(turn.completion_ids, skip_special_tokens=False)
            session.record(turn, _Reply("completion", reply=prompt_text + full))
            logprobs = None if req.top_logprobs is None else self._completion_logprobs(turn)
            choices.append(
                {"index": turn.choice, "text": text, "logprobs": logprobs, "finish_reason": finish}
            )
            completion_tokens += len(turn.completion_ids)
        reply = api.text_completion(req.model, choices, api.usage(len(prompt), completion_tokens))
        if req.stream:
            return await self._stream(request, api.completion_stream(reply, req.include_usage))
        return web.json_response(reply)

    @staticmethod
    async def _stream(request: web.Request, events: list[str]) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for event in events:
            await response.write(event.encode())
        await response.write_eof()
        return response

    # ---------------------------------------------------------------- prompts (token in)
    def _chat_prompt(
        self,
        session: Session,
        messages: list[dict[str, Any]],
        keys: list[str],
        tools: list[dict[str, Any]],
        tkey: str,
    ) -> tuple[list[int], Turn | None]:
        """The prompt ids of a chat request, and the turn they continue (None: rendered afresh)."""
        for turn, reply in zip(reversed(session.turns), reversed(session.replies), strict=True):
            if reply.kind != "chat" or reply.tools != tkey:
                continue
            k = len(reply.keys)
            if keys == reply.keys:  # the same conversation again: the same prompt ids
                return list(turn.prompt_ids), None
            if len(keys) > k and keys[:k] == reply.keys and keys[k] == reply.reply:
                last = turn.completion_ids[-1:] if isinstance(turn.matched, int) else []
                last_text = self.tokenizer.decode(last, skip_special_tokens=False) if last else None
                text = self.chat.continuation(messages[: k + 1], messages, tools, last_text)
                if text is not None:
                    return [*turn.ids, *self.chat.encode(text)], turn
        return self.chat.encode(self.chat.render(messages, tools, True)), None

    def _completion_prompt(
        self, session: Session, prompt: str | list[int]
    ) -> tuple[list[int], Turn | None, str]:
        """Token ids as given; a text that extends an earlier completion's prompt + completion text
        reuses its ids and encodes only the rest."""
        if isinstance(prompt, list):
            return list(prompt), None, self.tokenizer.decode(prompt, skip_special_tokens=False)
        best: tuple[Turn, str] | None = None
        for turn, reply in zip(session.turns, session.replies, strict=True):
            longer = best is None or len(reply.reply) >= len(best[1])
            if reply.kind == "completion" and prompt.startswith(reply.reply) and longer:
                best = (turn, reply.reply)
        if best is None:
            return self.chat.encode(prompt), None, prompt
        turn, done = best
        return [*turn.ids, *self.chat.encode(prompt[len(done) :])], turn, prompt

    # ---------------------------------------------------------------- generation (token out)
    def _max_new_tokens(self, session: Session, prompt_tokens: int, asked: int | None) -> int:
        limits = [session.sampling.get("max_new_tokens") if asked is None else asked]
        for name, limit in (
            ("the model's context", self.context_length),
            ("train.max_seq_len", session.max_seq_len),
        ):
            if limit is None:
                continue
            if prompt_tokens >= limit:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens ({name}); the messages "
                    f"take {prompt_tokens}.",
                    param="messages",
                    code="context_length_exceeded",
                )
            limits.append(limit - prompt_tokens)
        return min(v for v in limits if v is not None)

    async def _generate(
        self,
        request: web.Request,
        session: Session,
        req: api.Common,
        prompt: list[int],
        parent: Turn | None,
    ) -> list[Turn]:
        if not prompt:
            raise ApiError(400, "The prompt is empty.", param="messages")
        session.models.add(req.model)
        if req.requested:
            session.requested.append(req.requested)
        params = {
            **session.sampling,
            "max_new_tokens": self._max_new_tokens(session, len(prompt), req.max_tokens),
        }
        params.update(no_stop_trim=True, skip_special_tokens=False)
        if req.stop:
            params["stop"] = [*params.get("stop", []), *req.stop]
        call = session.calls
        session.calls += 1
        # The first choice continues `parent` (it asks only for the routing rows the merged sample
        # lacks); any other choice, or a parent another call already continued, starts a sample.
        key = None if parent is None else (parent.call, parent.choice)
        continues = key is not None and key not in session.continued
        if continues:
            session.continued.add(key)
        base_seed = params.pop("sampling_seed", None)

        async def one(choice: int) -> Turn:
            sampling = dict(params)
            if base_seed is not None:
                sampling["sampling_seed"] = (base_seed + SEED_STRIDE * (call * api.MAX_N + choice)) % 2**63
            start = len(parent.ids) - 1 if continues and choice == 0 and parent is not None else 0
            engine_call = _EngineCall(request, session, call, choice, sampling, req.top_logprobs)
            turn = await self._send(engine_call, prompt, start)
            while turn.finish_reason == "abort" and session.parked:  # the rollout ended: held
                turn = await self._continue(engine_call, turn)
            return turn

        try:
            turns = list(await asyncio.gather(*(one(i) for i in range(req.n))))
        except RequestTimedOut as exc:
            raise self._ended(session, Status.ABORTED, str(exc)) from None
        except FleetDown as exc:
            raise self._ended(session, Status.FAILED, str(exc), fatal=exc) from None
        except NoEngineAvailable as exc:
            raise self._ended(session, Status.FAILED, str(exc)) from None
        except SlimError as exc:  # the engine's 4xx: this request's fault
            raise ApiError(400, str(exc)) from None
        if any(t.finish_reason == "abort" for t in turns):
            raise self._ended(session, Status.ABORTED, "the rollout aborted the session's model calls")
        return turns

    async def _send(self, engine_call: _EngineCall, ids: list[int], start: int) -> Turn:
        """One engine request of a call, once the session runs (held while it is parked)."""
        session = engine_call.session
        await self._until_running(engine_call)
        extra: dict[str, Any] = {}
        if session.routing is not None:
            extra.update(return_routed_experts=True, routed_experts_start_len=start)
        if engine_call.top_logprobs:
            extra["top_logprobs_num"] = engine_call.top_logprobs
        session.sent(1)
        try:
            response = await self.client.generate(
                input_ids=ids,
                sampling_params=engine_call.sampling,
                return_logprob=True,
                rid=f"{session.rid_prefix}c{engine_call.call}-{engine_call.choice}",
                **extra,
            )
        finally:
            session.sent(-1)
        return turn_from_response(engine_call.call, engine_call.choice, ids, response, start)

    async def _continue(self, engine_call: _EngineCall, partial: Turn) -> Turn:
        """A call its rollout aborted, continued from its prompt + the ids it sampled (on the next
        rollout's weights once the session is resumed): one turn of both."""
        left = engine_call.sampling["max_new_tokens"] - len(partial.completion_ids)
        if left <= 0:
            return dataclasses.replace(partial, finish_reason="length")
        start = len(partial.ids) - 1 if _holds_rows(engine_call.session, partial) else partial.routing_start
        sampling = {**engine_call.sampling, "max_new_tokens": left}
        rest = await self._send(dataclasses.replace(engine_call, sampling=sampling), partial.ids, start)
        return joined(partial, rest)

    @staticmethod
    async def _until_running(engine_call: _EngineCall) -> None:
        """Wait while the session is parked; a session that ended meanwhile, or an agent that hung up
        on a held call, gets no engine request."""
        session = engine_call.session
        if session.running.is_set():
            return
        await session.running.wait()
        if session.status is not None:
            raise _ended_error(session.reason)
        transport = engine_call.request.transport
        if transport is None or transport.is_closing():
            raise ApiError(503, "The agent hung up while its call was held.", type="server_error", code=None)

    def _ended(
        self, session: Session, status: Status, reason: str, fatal: BaseException | None = None
    ) -> ApiError:
        session.end(status, reason, fatal)
        self.close_session(session, reason)
        return _ended_error(reason)

    # ---------------------------------------------------------------- replies
    def _text(self, turn: Turn) -> tuple[str, str]:
        """The completion as the agent gets it, and OpenAI's finish reason: the stop token or string
        the engine matched leaves the text (it stays in the sampled ids)."""
        ids, matched = turn.completion_ids, turn.matched
        if turn.finish_reason == "stop" and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if turn.finish_reason != "stop":
            return text, "length"
        if isinstance(matched, str) and matched in text:
            text = text[: text.find(matched)]  # as SGLang trims it
        return text, "stop"

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, turn: Turn) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content`: every sampled token, the stop token included."""
        tops = turn.top_logprobs or []
        out = []
        for i, (token_id, logprob) in enumerate(zip(turn.completion_ids, turn.logprobs, strict=True)):
            text = self._token(token_id)
            entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            alternatives = tops[i] if i < len(tops) and tops[i] else []
            entry["top_logprobs"] = [
                {"token": (t := self._token(int(a[1]))), "logprob": a[0], "bytes": list(t.encode())}
                for a in alternatives
            ]
            out.append(entry)
        return out

    def _completion_logprobs(self, turn: Turn) -> dict[str, Any]:
        tokens = [self._token(t) for t in turn.completion_ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        tops = turn.top_logprobs or []
        top = [{self._token(int(a[1])): a[0] for a in (row or [])} for row in tops] or None
        return {
            "tokens": tokens,
            "token_logprobs": list(turn.logprobs),
            "top_logprobs": top,
            "text_offset": offsets,
        }
