"""Running an agent for one sample: `rollout.agent_function_path` names

    async def run_agent(base_url: str, api_key: str, task: dict) -> float | dict

which the rollout calls once per sample (`n_samples_per_prompt` times per prompt), with a session of
its own on the endpoint. `task` is the data row: `{"prompt", "label", "metadata"}` (the keys
`data.input_key`, `label_key` and `metadata_key` name). The agent never sees a `Sample`.

Each run gets a thread and an event loop of its own, so an agent may block (the synchronous OpenAI
client, an SDK's `run_sync`) without stopping the rollout's loop, which serves the endpoint. The
run ends when the agent returns, at `rollout.agent_timeout_s`, or as soon as its session ends (a
failed or aborted model call): it is then cancelled (an agent blocked in synchronous code is left
to finish alone; its session is closed, so its calls get 404s).

What comes back: the trajectory's samples (`trajectory.build_samples`), each with the agent's
reward; a dict return is the reward with its named parts (`"score"` is trained on), its other
entries go to `metadata["agent"]["returned"]`. A run that raised, timed out, returned something
that is not a reward or never called the model is one failed sample whose `metadata["failure"]`
says why; a run whose session was aborted (the rollout ended, a call timed out) is an aborted one.

**Partial rollout.** At a rollout's end (`park_agent_runs`) its runs are parked, not ended: their
sessions hold their model calls (`endpoint.Session.park`) and the rollout gets each run's sample
back still pending, its run's id in `metadata["agent_run"]`, to buffer with its group. The agent
goes on in its thread and sees a slow reply. The rollout that draws the group next resumes the run
(`generate`): the held calls go to the engines, now on that rollout's weights, and the run ends
with its samples as any other. The time parked does not count against `rollout.agent_timeout_s`
(`RunClock`). A run still parked when the work ends is cancelled (`close_agents`); one whose
sample comes back from a checkpoint in another process starts over (a thread cannot be saved).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.rollout.agent.endpoint import AgentEndpoint, Session
from slimrl.rollout.agent.trajectory import build_samples
from slimrl.rollout.generate import EVALUATING, RolloutContext
from slimrl.rollout.hooks import load_hook
from slimrl.rollout.routing import RoutingLayout
from slimrl.sample import Sample, Status
from slimrl.utils.net import node_address

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 5.0
"""How long a cancelled agent may take to unwind before its thread is left behind."""


PARKED_KEY = "agent_run"
"""`Sample.metadata` key of a sample whose agent run is parked between rollouts: the run's id."""


class RunClock:
    """An agent run's time against `rollout.agent_timeout_s`; the time it is parked between rollouts
    does not count (the agent waits on the training step, not on itself)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.active_s = 0.0
        self.parked_s = 0.0
        self._since = time.monotonic()
        self._paused = False
        self._changed = asyncio.Event()

    def pause(self) -> None:
        if not self._paused:
            self.active_s += self._lap()
            self._paused = True
            self._changed.set()

    def resume(self) -> None:
        if self._paused:
            self.parked_s += self._lap()
            self._paused = False
            self._changed.set()

    def _lap(self) -> float:
        now = time.monotonic()
        lap, self._since = now - self._since, now
        return lap

    def left_s(self) -> float | None:
        """Active time left; None while paused."""
        if self._paused:
            return None
        return self.limit_s - self.active_s - (time.monotonic() - self._since)

    async def expired(self) -> None:
        """Return once the run has been active for `limit_s`."""
        while True:
            self._changed.clear()
            left = self.left_s()
            if left is not None and left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)


@dataclass
class AgentRun:
    session: Session
    clock: RunClock
    task: asyncio.Task[list[Sample]]

    def park(self) -> None:
        self.clock.pause()
        self.session.park()

    def resume(self, rid_prefix: str) -> None:
        self.clock.resume()
        self.session.resume(rid_prefix)


@dataclass
class Agents:
    """A rollout context's endpoint, in the event loop it serves from, and the agent runs in it
    (running, or parked between rollouts), by id (their session's)."""

    loop: asyncio.AbstractEventLoop
    endpoint: AgentEndpoint
    runs: dict[str, AgentRun] = field(default_factory=dict)
    started: asyncio.Future[AgentEndpoint] | None = None
    """The endpoint's start, awaited by every run."""


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    """The rollout's generate for `rollout.agent_function_path` (`rollout.load_generate_fn`): a new
    run for the sample, or its parked run resumed under this rollout's request ids."""
    agents = await agents_for(ctx)
    run = agents.runs.get(sample.metadata.pop(PARKED_KEY, None) or "")
    if run is not None:
        run.resume(f"{sample.metadata.get('rid')}-")
    else:
        run = _start_run(ctx, agents, sample, sampling_params)
    return await _ended_or_parked(agents, run, sample, ctx.rollout_id)


def _start_run(
    ctx: RolloutContext, agents: Agents, sample: Sample, sampling_params: dict[str, Any]
) -> AgentRun:
    agent = load_hook(ctx.config, "agent")
    assert agent is not None
    max_seq_len = None if EVALUATING.get() else ctx.config.train.max_seq_len  # eval is never trained on
    session = _open_session(agents.endpoint, sample, sampling_params, ctx.routing, max_seq_len)
    clock = RunClock(ctx.config.rollout.agent_timeout_s)
    task = asyncio.create_task(run_in_session(agents.endpoint, agent, sample, session, clock, ctx.routing))
    run = agents.runs[session.id] = AgentRun(session, clock, task)
    return run


async def _ended_or_parked(agents: Agents, run: AgentRun, sample: Sample, rollout_id: int) -> list[Sample]:
    """The run's samples once it ends; `sample`, still pending, once its rollout parked it and no
    call of it is at an engine. Cancelling the caller cancels the run."""
    settled = asyncio.ensure_future(run.session.settled.wait())
    try:
        await asyncio.wait({run.task, settled}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)
        agents.runs.pop(run.session.id, None)
        raise
    finally:
        settled.cancel()
    if run.task.done():
        agents.runs.pop(run.session.id, None)
        return run.task.result()
    sample.metadata[PARKED_KEY] = run.session.id
    sample.metadata.setdefault("start_rollout_id", rollout_id)
    return [sample]


def park_agent_runs(ctx: RolloutContext, rid_prefix: str) -> None:
    """Park the agent runs of the rollout whose request ids start with `rid_prefix` (its end, with
    `rollout.partial_rollout`): their calls are held from now on, those in flight once aborted."""
    agents = ctx.agents
    if agents is None:
        return
    for run in agents.runs.values():
        if run.session.rid_prefix.startswith(rid_prefix) and not run.task.done():
            run.park()


async def close_agents(ctx: RolloutContext) -> None:
    """The work ends: stop every agent run still running or parked (its session ends, its held calls
    answer 503, its agent is cancelled) and close the endpoint. In the agents' event loop."""
    agents, ctx.agents = ctx.agents, None
    if agents is None:
        return
    runs = list(agents.runs.values())
    agents.runs.clear()
    for run in runs:
        run.session.end(Status.ABORTED, "the run ended before the agent did")
    await asyncio.gather(*(run.task for run in runs), return_exceptions=True)
    await agents.endpoint.close()


async def agents_for(ctx: RolloutContext) -> Agents:
    """The context's agents, their endpoint started in this event loop on first use (once, however
    many runs start together)."""
    loop = asyncio.get_running_loop()
    agents = ctx.agents
    if agents is None or agents.loop is not loop:
        agents = ctx.agents = Agents(loop, _endpoint(ctx))
    if agents.started is None:
        agents.started = asyncio.ensure_future(agents.endpoint.start())
    await agents.started
    return agents


def _endpoint(ctx: RolloutContext) -> AgentEndpoint:
    rollout = ctx.config.rollout
    return AgentEndpoint(
        ctx.tokenizer,
        ctx.client,
        tool_call_parser=rollout.agent_tool_call_parser,
        context_length=read_model_arch(
            ctx.config.model.hf_checkpoint, ctx.config.model.overrides
        ).max_position_embeddings,
        host=node_address() if rollout.agent_endpoint_host == "node" else "127.0.0.1",
    )


def task_of(sample: Sample) -> dict[str, Any]:
    """The data row as the agent gets it (without what the rollout added to the metadata)."""
    added = ("rid", "start_rollout_id", PARKED_KEY)
    metadata = {k: v for k, v in sample.metadata.items() if k not in added}
    return {"prompt": sample.prompt, "label": sample.label, "metadata": metadata}


def _open_session(
    endpoint: AgentEndpoint,
    sample: Sample,
    sampling_params: dict[str, Any],
    routing: RoutingLayout | None,
    max_seq_len: int | None,
) -> Session:
    rid = sample.metadata.get("rid")
    return endpoint.open_session(
        sampling_params, f"{rid}-" if rid else None, routing=routing, max_seq_len=max_seq_len
    )


async def run_agent_sample(
    endpoint: AgentEndpoint,
    agent: Callable[..., Any],
    sample: Sample,
    sampling_params: dict[str, Any],
    *,
    timeout_s: float,
    routing: RoutingLayout | None = None,
    max_seq_len: int | None = None,
) -> list[Sample]:
    """Run `agent` once in a fresh session; the samples of its trajectory (see the module docstring)."""
    session = _open_session(endpoint, sample, sampling_params, routing, max_seq_len)
    return await run_in_session(endpoint, agent, sample, session, RunClock(timeout_s), routing)


async def run_in_session(
    endpoint: AgentEndpoint,
    agent: Callable[..., Any],
    sample: Sample,
    session: Session,
    clock: RunClock,
    routing: RoutingLayout | None,
) -> list[Sample]:
    """Run `agent` once in `session`, its time on `clock`; the samples of its trajectory."""
    args = (endpoint.base_url(session), endpoint.api_key, task_of(sample))
    try:
        outcome, value = await run_in_own_loop(agent, args, clock, session.ended)
    finally:
        endpoint.close_session(session)
        if session.calls:
            await endpoint.client.abort(session.rid_prefix)  # calls still in flight (a timeout)
    if session.fatal is not None:
        raise session.fatal
    info: dict[str, Any] = {"session": session.id, "calls": session.calls, "turns": len(session.turns)}
    if session.requested:
        info["sampling_not_applied"] = session.requested
    if session.parks:
        info["parked"] = {"times": session.parks, "seconds": round(clock.parked_s, 3)}
    if session.status is not None:
        return [_ended(sample, session.status, session.reason, info)]
    if outcome == "timeout":
        limit = clock.limit_s
        return [_ended(sample, Status.FAILED, f"the agent ran past rollout.agent_timeout_s={limit:g}", info)]
    if outcome == "raised":
        return [_ended(sample, Status.FAILED, f"the agent raised {type(value).__name__}: {value}", info)]
    reward, returned, problem = _reward(value)
    if problem is not None:
        return [_ended(sample, Status.FAILED, problem, info)]
    if not session.turns:
        return [_ended(sample, Status.FAILED, "the agent never called the model", info)]
    samples, splits = build_samples(session.turns, sample, routing)
    if splits:
        info["splits"] = splits
        logger.info(
            "agent run of sample %d: %d samples (%s)", sample.index, len(samples), splits[0]["reason"]
        )
    if returned:
        info["returned"] = returned
    for one in samples:
        one.reward = reward
        one.response = endpoint.tokenizer.decode(one.response_tokens, skip_special_tokens=False)
        one.metadata["agent"] = info
    return samples


def _ended(sample: Sample, status: Status, reason: str, info: dict[str, Any]) -> Sample:
    logger.warning("agent run of sample %d %s: %s", sample.index, status.value, reason)
    sample.status = status
    sample.metadata["failure"] = reason
    sample.metadata["agent"] = info
    return sample


def finite_number(value: Any) -> bool:
    """A real number (not a bool), finite: what a reward must be."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _reward(value: Any) -> tuple[float | dict[str, float], dict[str, Any], str | None]:
    """(reward, the returned dict's other entries, why the value is no reward)."""
    if finite_number(value):
        return float(value), {}, None
    if isinstance(value, dict) and finite_number(value.get("score")):
        parts = {str(k): float(v) for k, v in value.items() if finite_number(v)}
        return parts, {str(k): v for k, v in value.items() if not finite_number(v)}, None
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return 0.0, {}, f"the agent returned {shown}; expected a finite number or a dict with a finite 'score'"


async def run_in_own_loop(
    fn: Callable[..., Any], args: tuple[Any, ...], clock: RunClock, stop: asyncio.Event
) -> tuple[str, Any]:
    """Await `fn(*args)` in a thread with its own event loop: (`returned`, value), (`raised`, the
    exception), (`timeout`, None) once `clock` expired, or (`stopped`, None) once `stop` is set. The
    last two cancel the coroutine; so does cancelling the caller."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[tuple[str, Any]] = loop.create_future()
    handle: dict[str, Any] = {}
    lock = threading.Lock()

    def deliver(outcome: tuple[str, Any]) -> None:
        if not finished.done():
            finished.set_result(outcome)

    def target() -> None:
        agent_loop = asyncio.new_event_loop()
        try:
            with lock:
                task = agent_loop.create_task(fn(*args))
                handle["loop"], handle["task"] = agent_loop, task
            outcome: tuple[str, Any] = ("returned", agent_loop.run_until_complete(task))
        except BaseException as exc:  # the agent's, CancelledError included
            outcome = ("raised", exc)
        finally:
            _drain(agent_loop)
            with lock:
                agent_loop.close()
        with contextlib.suppress(RuntimeError):  # the rollout's loop is gone
            loop.call_soon_threadsafe(deliver, outcome)

    def cancel() -> None:
        with lock:
            agent_loop, task = handle.get("loop"), handle.get("task")
            if agent_loop is not None and not agent_loop.is_closed():
                agent_loop.call_soon_threadsafe(task.cancel)

    threading.Thread(target=target, name="slimrl-agent", daemon=True).start()
    watchers = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(clock.expired())}
    try:
        await asyncio.wait({finished, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        cancel()
        raise
    finally:
        for watcher in watchers:
            watcher.cancel()
    if finished.done():
        return finished.result()
    cancel()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(finished), CANCEL_GRACE_S)
    return ("stopped" if stop.is_set() else "timeout"), None


def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what the agent left running and close its async generators and executor."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    with contextlib.suppress(BaseException):
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
