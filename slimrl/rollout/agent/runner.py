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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import threading
from collections.abc import Callable
from typing import Any

from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.rollout.agent.endpoint import AgentEndpoint
from slimrl.rollout.agent.trajectory import build_samples
from slimrl.rollout.generate import EVALUATING, RolloutContext
from slimrl.rollout.hooks import load_hook
from slimrl.rollout.routing import RoutingLayout
from slimrl.sample import Sample, Status
from slimrl.utils.net import node_address

logger = logging.getLogger(__name__)

CANCEL_GRACE_S = 5.0
"""How long a cancelled agent may take to unwind before its thread is left behind."""


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    """The rollout's generate for `rollout.agent_function_path` (`rollout.load_generate_fn`)."""
    agent = load_hook(ctx.config, "agent")
    assert agent is not None
    endpoint = await endpoint_for(ctx)
    max_seq_len = None if EVALUATING.get() else ctx.config.train.max_seq_len  # eval is never trained on
    return await run_agent_sample(
        endpoint,
        agent,
        sample,
        sampling_params,
        timeout_s=ctx.config.rollout.agent_timeout_s,
        routing=ctx.routing,
        max_seq_len=max_seq_len,
    )


async def endpoint_for(ctx: RolloutContext) -> AgentEndpoint:
    """The context's endpoint, started in this event loop on first use."""
    loop = asyncio.get_running_loop()
    held = ctx.agent_endpoint
    if held is not None and held[0] is loop:
        return held[1]
    rollout = ctx.config.rollout
    endpoint = AgentEndpoint(
        ctx.tokenizer,
        ctx.client,
        tool_call_parser=rollout.agent_tool_call_parser,
        context_length=read_model_arch(
            ctx.config.model.hf_checkpoint, ctx.config.model.overrides
        ).max_position_embeddings,
        host=node_address() if rollout.agent_endpoint_host == "node" else "127.0.0.1",
    )
    await endpoint.start()
    ctx.agent_endpoint = (loop, endpoint)
    return endpoint


def task_of(sample: Sample) -> dict[str, Any]:
    """The data row as the agent gets it (without what the rollout added to the metadata)."""
    metadata = {k: v for k, v in sample.metadata.items() if k not in ("rid", "start_rollout_id")}
    return {"prompt": sample.prompt, "label": sample.label, "metadata": metadata}


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
    rid = sample.metadata.get("rid")
    session = endpoint.open_session(
        sampling_params, f"{rid}-" if rid else None, routing=routing is not None, max_seq_len=max_seq_len
    )
    args = (endpoint.base_url(session), endpoint.api_key, task_of(sample))
    try:
        outcome, value = await run_in_own_loop(agent, args, timeout_s, session.ended)
    finally:
        endpoint.close_session(session)
        if session.calls:
            await endpoint.client.abort(session.rid_prefix)  # calls still in flight (a timeout)
    if session.fatal is not None:
        raise session.fatal
    info: dict[str, Any] = {"session": session.id, "calls": session.calls, "turns": len(session.turns)}
    if session.requested:
        info["sampling_not_applied"] = session.requested
    if session.status is not None:
        return [_ended(sample, session.status, session.reason, info)]
    if outcome == "timeout":
        return [
            _ended(sample, Status.FAILED, f"the agent ran past rollout.agent_timeout_s={timeout_s:g}", info)
        ]
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
    fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, stop: asyncio.Event
) -> tuple[str, Any]:
    """Await `fn(*args)` in a thread with its own event loop: (`returned`, value), (`raised`, the
    exception), (`timeout`, None) past `timeout_s`, or (`stopped`, None) once `stop` is set. The last
    two cancel the coroutine; so does cancelling the caller."""
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
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait(
            {finished, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        cancel()
        raise
    finally:
        stopped.cancel()
    if finished in done:
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
