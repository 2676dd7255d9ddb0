"""The agentic endpoint (`slimrl/rollout/agent/`, issue 24) driven by the official `openai` client,
against real SGLang 0.5.23 and the embedded engine.

The model: a tiny Qwen3-MoE whose output layer is solved (least squares over its own final hidden
states) so that, greedily, it answers the example agent's task with exactly the tool call the chat
template renders, and the tool's result with the answer. Everything expected comes from outside
the endpoint: the ids the engine itself was fed and returned (a recording proxy between the endpoint
and the engine keeps every `/generate` body), the chat template applied to the whole conversation,
Hugging Face's router for routed experts, and OpenAI's schemas for the shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import numpy as np
import openai
import pytest
import requests
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples import arithmetic_environment, openai_agent
from slimrl.data.prompts import PromptRecord
from slimrl.data.sft import sft_sample
from slimrl.data.tiny_models import make_tiny
from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.orchestration.sample_log import SampleLog
from slimrl.preflight import load_config
from slimrl.rollout.agent.endpoint import AgentEndpoint
from slimrl.rollout.agent.environment import Step, environment_agent
from slimrl.rollout.agent.runner import RunClock, close_agents, run_agent_sample, run_in_own_loop
from slimrl.rollout.client import FleetClient
from slimrl.rollout.data_source import DataSource
from slimrl.rollout.generate import RolloutContext
from slimrl.rollout.rollout import rollout_metrics, run_rollout
from slimrl.rollout.routing import RoutingLayout
from slimrl.sample import Sample, Status
from slimrl.sampled import check_sampled
from tests.conftest import REPO
from tests.engines import ENGINES, hf_routing, running_engines

pytestmark = pytest.mark.slow

TASK = {"prompt": "What is 2+3?", "label": "5", "metadata": {}}
ARGUMENTS = {"a": 2, "b": 3}
ANSWER = "2+3=5"
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 96}
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------- the model
def _conversation(tokenizer: Any) -> tuple[str, str, str, str]:
    """The example agent's conversation as the chat template renders it: (first prompt, tool call,
    prompt after the tool's result, answer)."""
    user = openai_agent.first_messages(TASK)
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": ARGUMENTS}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": "c", "content": str(openai_agent.add(**ARGUMENTS))}
    render = tokenizer.apply_chat_template
    first = render(user, tools=openai_agent.TOOLS, tokenize=False, add_generation_prompt=True)
    after_tool = render(
        [*user, assistant, tool], tools=openai_agent.TOOLS, tokenize=False, add_generation_prompt=True
    )
    head = render([*user, assistant], tools=openai_agent.TOOLS, tokenize=False)
    tool_call = head[len(first) :].removesuffix("\n").removesuffix(tokenizer.eos_token)
    return first, tool_call, after_tool, ANSWER


def fit_tool_model(out: Path) -> Path:
    """A tiny Qwen3-MoE (hidden size 128) whose lm_head maps its final hidden state at every position
    of the two answers to that position's next token with a margin of 20 logits: solved exactly
    (128 dimensions for under 100 positions), so greedy decoding on any engine writes them."""
    make_tiny("qwen3_moe", out, overrides={"hidden_size": 128})
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    first, tool_call, after_tool, answer = _conversation(tokenizer)
    features, targets = [], []
    with torch.no_grad():
        for prompt, target in ((first, tool_call), (after_tool, answer)):
            ids = tokenizer.encode(prompt + target + tokenizer.eos_token, add_special_tokens=False)
            start = len(tokenizer.encode(prompt, add_special_tokens=False))
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
            features.append(hidden[start - 1 : len(ids) - 1])
            targets.append(torch.tensor(ids[start:]))
    h, y = torch.cat(features).double(), torch.cat(targets)
    assert h.shape[0] < h.shape[1], "more positions than dimensions: not solvable exactly"
    logits = torch.zeros(len(y), model.lm_head.weight.shape[0], dtype=torch.float64)
    logits[torch.arange(len(y)), y] = 20.0
    model.lm_head.weight.data = (torch.linalg.pinv(h) @ logits).T.float()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        shutil.copy(Path(tmp) / "model.safetensors", out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    return fit_tool_model(tmp_path_factory.mktemp("agent") / "qwen3_moe_tools")


# ---------------------------------------------------------------- engine, proxy, endpoint
class LoopThread:
    """An event loop on a thread of its own: the endpoint serves from it while the test (and the
    synchronous OpenAI client) runs here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Recorder:
    """A pass-through proxy to the engine that keeps every `/generate` request and reply body."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.calls: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{path:.*}", self.forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method, f"{self.engine_url}{request.path_qs}", data=body, headers=headers
            ) as reply,
        ):
            out = await reply.read()
            status, content_type = reply.status, reply.content_type
        if request.path == "/generate" and status == 200:
            self.calls.append((json.loads(body), json.loads(out)))
        return web.Response(body=out, status=status, content_type=content_type)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class Stack:
    def __init__(self, kind: str, model: Path, loop: LoopThread, recorder: Recorder, endpoint: AgentEndpoint):
        self.kind, self.model, self.loop, self.recorder, self.endpoint = kind, model, loop, recorder, endpoint
        self.tokenizer = endpoint.tokenizer
        self.layout = RoutingLayout.of(read_model_arch(model))

    def session(self, **kwargs: Any):
        return self.endpoint.open_session(GREEDY, routing=self.layout, **kwargs)

    def client(self, session: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.endpoint.base_url(session), api_key=self.endpoint.api_key, max_retries=0
        )

    def mark(self) -> int:
        return len(self.recorder.calls)

    def run_agent(self, agent: Any, timeout_s: float = 120.0, **sample: Any) -> list[Sample]:
        base = Sample(index=7, group_index=3, prompt=TASK["prompt"], label=TASK["label"], **sample)
        coro = run_agent_sample(
            self.endpoint, agent, base, GREEDY, timeout_s=timeout_s, routing=self.layout, max_seq_len=2048
        )
        return self.loop.run(coro)


@pytest.fixture(scope="module", params=ENGINES)
def stack(request, tool_model, tmp_path_factory) -> Iterator[Stack]:
    kind = request.param
    log_dir = tmp_path_factory.mktemp(f"agent-{kind}")
    loop = LoopThread()
    overrides = ("algorithm.routing_replay=true", "rollout.sglang.extra_args.tool_call_parser=qwen25")
    with running_engines(kind, tool_model, log_dir, 1, *overrides) as (url,):
        recorder = Recorder(url)
        loop.run(recorder.start())
        tokenizer = AutoTokenizer.from_pretrained(tool_model)
        endpoint = AgentEndpoint(tokenizer, FleetClient([recorder.url]), context_length=512)
        loop.run(endpoint.start())
        try:
            yield Stack(kind, tool_model, loop, recorder, endpoint)
        finally:
            loop.run(endpoint.close())
            loop.run(endpoint.client.close())
            loop.run(recorder.close())
            loop.stop()


# ---------------------------------------------------------------- agents
async def raising_agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    raise RuntimeError("the tool server is down")


async def blocking_agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    time.sleep(3)  # synchronous: blocks its own thread, never the endpoint's loop
    return 1.0


async def synchronous_agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    """The synchronous client inside an `async def`: it blocks this run's own loop only."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    reply = client.chat.completions.create(
        model="m", messages=openai_agent.first_messages(task), max_tokens=3
    )
    return float(reply.usage.completion_tokens)


async def silent_agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    return 1.0


async def unscored_agent(base_url: str, api_key: str, task: dict[str, Any]) -> Any:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    return "five"


async def editing_agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    """Runs the tool, then rewrites the user's question before sending the conversation back."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        messages = openai_agent.first_messages(task)
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=openai_agent.TOOLS, max_tokens=96
        )
        message = reply.choices[0].message
        call = message.tool_calls[0]
        edited = [
            {"role": "user", "content": "What is 2+3? Use the tool."},
            message.model_dump(exclude_none=True),
        ]
        edited.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        await client.chat.completions.create(
            model="m", messages=edited, tools=openai_agent.TOOLS, max_tokens=8
        )
    return 0.5


# ---------------------------------------------------------------- tests
def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def test_chat_completion_shape_usage_and_logprobs(stack: Stack) -> None:
    session = stack.session()
    mark = stack.mark()
    raw = stack.client(session).chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=openai_agent.first_messages(TASK),
        tools=openai_agent.TOOLS,
        n=2,
        logprobs=True,
        top_logprobs=2,
        max_tokens=96,
    )
    body = raw.http_response.json()
    reply = raw.parse()
    # OpenAI's chat.completion object: the keys of its schema, the model name as sent
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert reply.model == "gpt-4o-mini" and [c.index for c in reply.choices] == [0, 1]
    calls = stack.recorder.calls[mark:]
    assert len(calls) == 2  # one engine request per choice
    for choice, (_, answer) in zip(reply.choices, calls, strict=True):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.role == "assistant" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "add" and json.loads(call.function.arguments) == ARGUMENTS
        engine = answer["meta_info"]["output_token_logprobs"]
        assert [e.logprob for e in choice.logprobs.content] == [t[0] for t in engine]
        assert [e.token for e in choice.logprobs.content] == [stack.tokenizer.decode([t[1]]) for t in engine]
        tops = answer["meta_info"]["output_top_logprobs"]
        assert [[t.logprob for t in e.top_logprobs] for e in choice.logprobs.content] == [
            [t[0] for t in row] for row in tops
        ]
        assert all(e.top_logprobs[0].token == e.token for e in choice.logprobs.content)  # greedy
    # usage counts exactly what the engine was fed (once) and returned (every choice)
    assert reply.usage.prompt_tokens == len(calls[0][0]["input_ids"]) == len(calls[1][0]["input_ids"])
    assert reply.usage.completion_tokens == sum(len(a["output_ids"]) for _, a in calls)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # the template was applied once, by the endpoint: the engine got the template's own rendering
    first, _, _, _ = _conversation(stack.tokenizer)
    assert stack.tokenizer.decode(calls[0][0]["input_ids"]) == first
    assert calls[0][0]["sampling_params"]["no_stop_trim"] is True and calls[0][0]["return_logprob"] is True
    # streamed, the same reply as chunks
    chunks = list(
        stack.client(session).chat.completions.create(
            model="m", messages=openai_agent.first_messages(TASK), tools=openai_agent.TOOLS, max_tokens=96,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [t[0].function.name for t in streamed] == ["add"] and chunks[-1].usage.completion_tokens == len(
        stack.recorder.calls[-1][1]["output_ids"]
    )
    # tool_choice none: the text as sampled, no parsing
    none = stack.client(session).chat.completions.create(
        model="m", messages=openai_agent.first_messages(TASK), tools=openai_agent.TOOLS, tool_choice="none",
        max_tokens=96,
    )  # fmt: skip
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content == _conversation(stack.tokenizer)[1]


def _reply(reply: dict[str, Any]) -> dict[str, Any]:
    """What must agree between two chat completions (call ids are random)."""
    (choice,) = reply["choices"]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"].get("tool_calls") or []
    ]
    usage = (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
    return {
        "content": choice["message"]["content"],
        "calls": calls,
        "finish": choice["finish_reason"],
        "usage": usage,
    }


@pytest.mark.parametrize("stack", ["sglang"], indirect=True)
def test_the_endpoint_renders_and_replies_as_sglangs_own_chat_completions(stack: Stack) -> None:
    """The referee for the chat side: real SGLang's own `/v1/chat/completions` (launched with the
    same tool-call parser) and slimrl's endpoint in front of the same server, asked the same
    conversation greedily over two turns, send the engine the same prompt ids, get the same
    completion ids and reply with the same content, tool calls, finish reason and usage.

    One difference, kept on purpose: SGLang 0.5.23 renders each tool as its pydantic `Tool` dumps
    it, adding `"defer_loading": null`; slimrl renders the tools as the agent sent them, as
    transformers' `apply_chat_template` and an SFT data set do. So the tools here carry that field,
    and the last request shows the difference is exactly its tokens."""
    as_sglang_dumps = [{**tool, "defer_loading": None} for tool in openai_agent.TOOLS]
    session = stack.session()
    url = f"{stack.endpoint.base_url(session)}/chat/completions"
    auth = {"Authorization": f"Bearer {stack.endpoint.api_key}"}
    extras = {"temperature": 0.0, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    messages = openai_agent.first_messages(TASK)
    for follow_up in ("and 4+4?", None):
        ask = {"model": "m", "messages": messages, "tools": as_sglang_dumps, "max_tokens": 12}
        mark = stack.mark()
        mine = requests.post(url, json=ask, headers=auth, timeout=120).json()
        ((sent, got),) = stack.recorder.calls[mark:]
        theirs = requests.post(
            f"{stack.recorder.engine_url}/v1/chat/completions", json={**ask, **extras}, timeout=120
        )
        theirs = theirs.json()
        assert sent["input_ids"] == theirs["sglext"]["input_ids"]
        assert [got["output_ids"]] == theirs["sglext"]["output_ids"]
        assert _reply(mine) == _reply(theirs)
        if follow_up is not None:  # the conversation goes on: slimrl continues from the sampled ids
            messages = [*messages, mine["choices"][0]["message"], {"role": "user", "content": follow_up}]
    plain = {"model": "m", "messages": messages[:1], "tools": openai_agent.TOOLS, "max_tokens": 1}
    mine = requests.post(url, json=plain, headers=auth, timeout=120).json()
    theirs = requests.post(
        f"{stack.recorder.engine_url}/v1/chat/completions", json={**plain, **extras}, timeout=120
    )
    added = len(stack.tokenizer.encode(', "defer_loading": null', add_special_tokens=False))
    assert theirs.json()["usage"]["prompt_tokens"] - mine["usage"]["prompt_tokens"] == added


def test_multi_turn_tool_calls_train_on_exactly_the_sampled_tokens(stack: Stack) -> None:
    mark = stack.mark()
    (sample,) = stack.run_agent(openai_agent.run_agent)
    calls = stack.recorder.calls[mark:]
    assert len(calls) == 2, "a tool call, then the answer"
    (in1, out1), (in2, out2) = calls
    p1, c1, p2, c2 = in1["input_ids"], out1["output_ids"], in2["input_ids"], out2["output_ids"]
    assert sample.status == Status.COMPLETED and sample.reward == {"score": 1.0, "tool_calls": 1.0}
    # one sequence: the second prompt extends the first prompt + its completion, as the engine saw them
    assert p2[: len(p1) + len(c1)] == p1 + c1
    assert sample.tokens == p2 + c2 and sample.prompt_tokens == p1
    # trained tokens are exactly the engine's output ids, with the engine's logprobs
    mask = np.array(sample.loss_mask, dtype=bool)
    response = np.array(sample.response_tokens)
    assert response[mask].tolist() == c1 + c2
    assert mask.tolist() == [True] * len(c1) + [False] * (len(p2) - len(p1) - len(c1)) + [True] * len(c2)
    logprobs = [
        t[0] for t in out1["meta_info"]["output_token_logprobs"] + out2["meta_info"]["output_token_logprobs"]
    ]
    assert np.array(sample.rollout_log_probs)[mask].tolist() == logprobs
    assert not np.array(sample.rollout_log_probs)[~mask].any()
    # the whole sequence is the chat template's rendering of the conversation, closed by the answer
    first, tool_call, after_tool, answer = _conversation(stack.tokenizer)
    eos = stack.tokenizer.eos_token
    assert stack.tokenizer.decode(sample.tokens) == after_tool + answer + eos
    assert stack.tokenizer.decode(c1) == tool_call + eos and stack.tokenizer.decode(c2) == answer + eos
    # the tokens between (the template's turn ends, the tool's result) are not trained on
    between = stack.tokenizer.decode(response[~mask].tolist())
    assert between == after_tool[len(first + tool_call + eos) :] and "<tool_response>\n5\n" in between
    check_sampled(sample, "test")
    # routed experts for every token, stitched across the calls: Hugging Face's router's choice
    expected = hf_routing(stack.model, sample.tokens)
    assert sample.rollout_routed_experts.shape == expected.shape
    assert (np.sort(sample.rollout_routed_experts, -1) == np.sort(expected, -1)).all()
    assert in2["routed_experts_start_len"] == len(p1) + len(c1) - 1  # only the rows the sample lacked
    info = sample.metadata["agent"]
    assert info["calls"] == 2 and "splits" not in info
    assert rollout_metrics([[sample]], 1.0, {})["agent_splits"] == 0.0


def test_the_openai_agents_sdk_runs_unchanged_and_trains_on_its_sampled_tokens(stack: Stack) -> None:
    """The same task written with the OpenAI Agents SDK (`examples/openai_agents_sdk.py`): the SDK's
    own loop calls the tool and answers, and the sample is that conversation as the engine produced
    it, token for token the plain-SDK agent's (same messages, same tool schema)."""
    from examples import openai_agents_sdk

    mark = stack.mark()
    (sample,) = stack.run_agent(openai_agents_sdk.run_agent)
    (in1, out1), (in2, out2) = stack.recorder.calls[mark:]  # a tool call, then the answer
    assert sample.status == Status.COMPLETED and sample.reward == {"score": 1.0, "tool_calls": 1.0}
    first = in1["input_ids"] + out1["output_ids"]
    assert in2["input_ids"][: len(first)] == first and sample.tokens == in2["input_ids"] + out2["output_ids"]
    mask = np.array(sample.loss_mask, dtype=bool)
    assert np.array(sample.response_tokens)[mask].tolist() == out1["output_ids"] + out2["output_ids"]
    check_sampled(sample, "test")
    (plain,) = stack.run_agent(openai_agent.run_agent)
    assert (sample.tokens, sample.loss_mask) == (plain.tokens, plain.loss_mask)


class TwoTurns:
    """An environment that records what it was told: a system and a user turn to start, gym's tuple
    after the first reply, a `Step` with info after the second."""

    actions: ClassVar[list[str]] = []

    def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        TwoTurns.actions = []
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["prompt"]}]

    async def step(self, action: str) -> Any:
        TwoTurns.actions.append(action)
        if len(TwoTurns.actions) == 1:
            return ("Check it once more.", 0.25, False)
        return Step(reward=0.5, done=True, info={"chars": len(action), "note": "not a number"})


def test_an_environment_plays_through_the_endpoint_and_trains_on_the_sampled_tokens(stack: Stack) -> None:
    """`environment_agent` (the gym shape): the environment gets exactly the text the engine
    sampled, its observations are the next turns (loss mask 0), the reward is the steps' sum."""
    mark = stack.mark()
    (sample,) = stack.run_agent(environment_agent(TwoTurns, max_turns=5))
    (in1, out1), (in2, out2) = stack.recorder.calls[mark:]  # done after the second reply
    c1, c2 = out1["output_ids"], out2["output_ids"]
    decode = stack.tokenizer.decode
    assert TwoTurns.actions == [decode(c, skip_special_tokens=True) for c in (c1, c2)]
    # the untrained model may run to max_new_tokens: the sample ends as its last reply did
    stopped = out2["meta_info"]["finish_reason"]["type"] == "stop"
    assert sample.status == (Status.COMPLETED if stopped else Status.TRUNCATED)
    assert sample.reward == {
        "score": 0.75,
        "turns": 2.0,
        "done": 1.0,
        "chars": float(len(TwoTurns.actions[1])),
    }
    first = stack.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TASK["prompt"]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert decode(in1["input_ids"]) == first
    assert in2["input_ids"][: len(in1["input_ids"]) + len(c1)] == in1["input_ids"] + c1
    mask = np.array(sample.loss_mask, dtype=bool)
    response = np.array(sample.response_tokens)
    assert sample.tokens == in2["input_ids"] + c2 and response[mask].tolist() == c1 + c2
    assert "Check it once more." in decode(response[~mask].tolist())
    check_sampled(sample, "test")


def test_the_example_environment_rewards_only_a_correct_answer(stack: Stack) -> None:
    """`examples/arithmetic_environment.py`: up to three replies, feedback between; the reward is 1
    exactly when a reply's last integer is the label (read here from the engine's own output)."""
    mark = stack.mark()
    (sample,) = stack.run_agent(arithmetic_environment.run_agent)
    calls = stack.recorder.calls[mark:]
    outputs = [stack.tokenizer.decode(out["output_ids"], skip_special_tokens=True) for _, out in calls]
    correct = [bool(n) and n[-1] == TASK["label"] for n in (re.findall(r"-?\d+", text) for text in outputs)]
    assert len(outputs) == (correct.index(True) + 1 if any(correct) else 3)
    stopped = calls[-1][1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert sample.status == (Status.COMPLETED if stopped else Status.TRUNCATED)
    assert sample.reward["score"] == float(any(correct))
    assert sample.reward["turns"] == len(outputs) and sample.reward["tries"] == len(outputs)
    assert sum(sample.loss_mask) == sum(len(out["output_ids"]) for _, out in calls)
    check_sampled(sample, "test")


class BadReset:
    def reset(self, task: dict[str, Any]) -> int:
        return 5

    def step(self, action: str) -> Step:
        return Step(done=True)


class DownReset(BadReset):
    def reset(self, task: dict[str, Any]) -> int:
        raise RuntimeError("the simulator is down")


def test_a_history_editing_agent_gives_separate_samples(stack: Stack) -> None:
    mark = stack.mark()
    samples = stack.run_agent(editing_agent)
    calls = stack.recorder.calls[mark:]
    assert len(samples) == 2 and len(calls) == 2
    for sample, (request, answer) in zip(samples, calls, strict=True):
        assert sample.tokens == request["input_ids"] + answer["output_ids"]
        assert sample.response_tokens == answer["output_ids"] and sample.loss_mask == [1] * len(
            answer["output_ids"]
        )
        assert sample.reward == 0.5
        check_sampled(sample, "test")
        expected = hf_routing(stack.model, sample.tokens)
        assert (np.sort(sample.rollout_routed_experts, -1) == np.sort(expected, -1)).all()
    (split,) = samples[0].metadata["agent"]["splits"]
    assert split["call"] == 1 and "does not extend" in split["reason"]
    metrics = rollout_metrics([samples], 1.0, {})  # one run, split once: the rollout's metrics say so
    assert metrics["agent_runs"] == 1.0 and metrics["agent_splits"] == 1.0


def test_completions_continue_from_the_sampled_ids(stack: Stack) -> None:
    session = stack.session()
    client = stack.client(session)
    mark = stack.mark()
    first = client.completions.create(model="m", prompt="12+34=", max_tokens=6, logprobs=0)
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    text = first.choices[0].text
    second = client.completions.create(model="m", prompt="12+34=" + text + "\n7+8=", max_tokens=3)
    (in1, out1), (in2, out2) = stack.recorder.calls[mark:]
    assert in2["input_ids"][: len(in1["input_ids"]) + 6] == in1["input_ids"] + out1["output_ids"]
    assert first.usage.completion_tokens == 6 == len(out1["output_ids"])
    assert second.usage.prompt_tokens == len(in2["input_ids"])
    engine = [t[0] for t in out1["meta_info"]["output_token_logprobs"]]
    assert first.choices[0].logprobs.token_logprobs == engine
    samples, _ = _build(stack, session)
    assert len(samples) == 1 and samples[0].tokens == in2["input_ids"] + out2["output_ids"]
    # a stop string ends the text (OpenAI) and stays in the sampled ids
    stop = text[2:4]
    stopped = client.completions.create(model="m", prompt="12+34=", max_tokens=6, stop=[stop]).choices[0]
    sampled = stack.tokenizer.decode(stack.recorder.calls[-1][1]["output_ids"])
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.find(stop)]
    assert sampled == text[: text.find(stop) + len(stop)]


def _build(stack: Stack, session: Any) -> tuple[list[Sample], list[dict[str, Any]]]:
    from slimrl.rollout.agent.trajectory import build_samples

    return build_samples(session.turns, Sample(), stack.layout)


def test_bad_key_unknown_session_and_malformed_requests_are_openai_errors(stack: Stack) -> None:
    session = stack.session()
    messages = [{"role": "user", "content": "hi"}]
    bad_key = openai.OpenAI(base_url=stack.endpoint.base_url(session), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad_key.chat.completions.create(model="m", messages=messages)
    assert info.value.status_code == 401 and _error(info.value)["code"] == "invalid_api_key"
    unknown = openai.OpenAI(
        base_url=f"{stack.endpoint.url}/sessions/nosuchsession/v1",
        api_key=stack.endpoint.api_key,
        max_retries=0,
    )
    with pytest.raises(openai.NotFoundError) as info:
        unknown.chat.completions.create(model="m", messages=messages)
    assert info.value.status_code == 404 and _error(info.value)["type"] == "invalid_request_error"
    client = stack.client(session)
    malformed = [
        ({"messages": []}, "messages"),
        ({"messages": messages, "temperature": "hot"}, "temperature"),
        ({"messages": messages, "n": 0}, "n"),
        ({"messages": messages, "max_tokens": -1}, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": messages, "tools": [{"type": "function"}]}, "tools[0]"),
        ({"messages": messages, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"messages": messages, "no_such_option": 1}, "no_such_option"),
    ]
    mark = stack.mark()
    for body, param in malformed:
        with pytest.raises(openai.BadRequestError) as info:
            fields = dict(body)  # as JSON, whatever the client's types allow
            client.chat.completions.create(model="m", messages=fields.pop("messages"), extra_body=fields)
        error = _error(info.value)
        assert info.value.status_code == 400 and error["param"] == param, (param, error)
    raw = requests.post(
        f"{stack.endpoint.base_url(session)}/chat/completions",
        data=b"{not json",
        headers={"Authorization": f"Bearer {stack.endpoint.api_key}"},
        timeout=30,
    )
    assert raw.status_code == 400 and set(raw.json()["error"]) == ERROR_KEYS
    long = [{"role": "user", "content": "x" * 600}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=long)
    assert _error(info.value)["code"] == "context_length_exceeded"
    assert stack.mark() == mark, "no malformed request reached the engine"
    ok = client.chat.completions.create(model="m", messages=messages, max_tokens=2)  # the session goes on
    assert ok.usage.completion_tokens == len(stack.recorder.calls[-1][1]["output_ids"])


@pytest.mark.parametrize(
    ("agent", "reason"),
    [
        (raising_agent, "the agent raised RuntimeError: the tool server is down"),
        (blocking_agent, "the agent ran past rollout.agent_timeout_s=1"),
        (silent_agent, "the agent never called the model"),
        (unscored_agent, "the agent returned 'five'"),
        (environment_agent(DownReset), "the agent raised RuntimeError: the simulator is down"),
        (environment_agent(BadReset), "the agent raised TypeError: the environment's reset() gave int"),
    ],
    ids=["raises", "times-out", "never-calls", "no-reward", "environment-raises", "environment-misbehaves"],
)
def test_a_failing_agent_is_a_failed_sample_with_its_reason(stack: Stack, agent: Any, reason: str) -> None:
    started = time.monotonic()
    (sample,) = stack.run_agent(agent, timeout_s=1.0)
    assert sample.status == Status.FAILED and sample.metadata["failure"].startswith(reason)
    assert time.monotonic() - started < 30
    assert sample.tokens == [] and sample.reward is None


async def picky_agent(base_url: str, api_key: str, task: dict[str, Any]) -> Any:
    """The example agent, except on the task labelled `broken`: there its tool server is down."""
    if task["label"] == "broken":
        return await raising_agent(base_url, api_key, task)
    return await openai_agent.run_agent(base_url, api_key, task)


def test_a_group_with_a_failed_agent_run_is_set_aside_and_logged_with_its_reason(
    stack: Stack, tmp_path: Path
) -> None:
    """A rollout trains on finished groups only; the group whose agent run failed is set aside
    (`RolloutResult.unfinished`) and the sample log keeps it (`train/unfinished`, the reason in
    `metadata["failure"]`) instead of dropping it silently."""
    data = tmp_path / "tasks.jsonl"
    rows = [{"prompt": TASK["prompt"], "label": TASK["label"]}, {"prompt": TASK["prompt"], "label": "broken"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(None, [
        f"model.hf_checkpoint={stack.model}", f"data.prompt_data={data}", "cluster.gpus_per_node=1",
        f"rollout.agent_function_path={__name__}.picky_agent", "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2", "rollout.sampling.temperature=0",
    ])  # fmt: skip
    ctx = RolloutContext(config, stack.tokenizer, stack.endpoint.client)
    result = stack.loop.run(run_rollout(ctx, DataSource(config)))
    assert len(result.groups) == 2 and all(s.label == TASK["label"] for g in result.groups for s in g)
    assert result.unfinished and result.metrics["unfinished_groups"] == len(result.unfinished)
    for group in result.unfinished:
        assert [s.label for s in group] == ["broken", "broken"]
        assert all(s.status == Status.FAILED for s in group)
        assert all(s.metadata["failure"].startswith("the agent raised RuntimeError") for s in group)
    log = SampleLog(tmp_path)
    log.append(0, result.groups, unfinished=result.unfinished)
    log.close()
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    splits = [r["split"] for r in records]
    assert splits == ["train"] * 4 + ["train/unfinished"] * (2 * len(result.unfinished))
    assert {r["status"] for r in records[4:]} == {"failed"}
    assert all("tool server is down" in r["metadata"]["failure"] for r in records[4:])


def test_a_synchronous_agent_runs_in_a_thread_of_its_own(stack: Stack) -> None:
    mark = stack.mark()
    (sample,) = stack.run_agent(synchronous_agent)
    ((request, answer),) = stack.recorder.calls[mark:]
    assert sample.status == Status.TRUNCATED and sample.reward == 3.0
    assert sample.tokens == request["input_ids"] + answer["output_ids"]


def test_the_rollout_runs_the_agent_per_sample(stack: Stack, tmp_path: Path) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"prompt": TASK["prompt"], "label": TASK["label"]}) + "\n")
    config = load_config(
        None,
        [
            f"model.hf_checkpoint={stack.model}",
            f"data.prompt_data={data}",
            "rollout.agent_function_path=examples.openai_agent.run_agent",
            "cluster.gpus_per_node=1",
            "rollout.rollout_batch_size=1",
            "rollout.n_samples_per_prompt=2",
            "rollout.sampling.temperature=0",
            "algorithm.routing_replay=true",
        ],
    )
    ctx = RolloutContext(config, stack.tokenizer, stack.endpoint.client)
    result = stack.loop.run(run_rollout(ctx, DataSource(config)))
    (group,) = result.groups
    assert len(group) == 2 and all(s.status == Status.COMPLETED for s in group)
    assert [s.reward for s in group] == [{"score": 1.0, "tool_calls": 1.0}] * 2
    _, _, after_tool, answer = _conversation(stack.tokenizer)
    assert all(
        stack.tokenizer.decode(s.tokens) == after_tool + answer + stack.tokenizer.eos_token for s in group
    )
    assert result.metrics["raw_reward"] == 1.0 and result.metrics["failed_samples"] == 0
    # The same conversation as an SFT record in OpenAI's message format (a warm start's data) is
    # the same training sequence: the same ids, the same response and the same loss mask.
    call = {"id": "x", "type": "function", "function": {"name": "add", "arguments": json.dumps(ARGUMENTS)}}
    messages = [
        *openai_agent.first_messages(TASK),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "x", "content": str(openai_agent.add(**ARGUMENTS))},
        {"role": "assistant", "content": ANSWER},
    ]
    record = PromptRecord(prompt=messages, label=None, metadata={}, tools=openai_agent.TOOLS)
    sft = sft_sample(stack.tokenizer, record, apply_chat_template=True)
    for s in group:
        assert sft.tokens == s.tokens and sft.response_length == s.response_length
        assert sft.loss_mask == s.loss_mask
    stack.loop.run(close_agents(ctx))


# ---------------------------------------------------------------- partial rollout
PING = {"prompt": "ping", "label": "ping"}
PARKED_S = 6.0
"""How long the test keeps a run parked: longer than its agent timeout, which must not count it."""
engine_url: dict[str, str] = {}
"""The engine the ping agent watches (set by the test)."""


async def parking_agent(base_url: str, api_key: str, task: dict[str, Any]) -> Any:
    """The example agent, except on the `ping` task: that one waits until the example agent's first
    model call is at the engine, then asks for one token and is done, which fills the batch (one
    group) while that call is still generating: the rollout ends and parks the example agent's run.
    (Its one token comes with its prefill, at the earliest with the other call's first token.)"""
    if task["label"] != PING["label"]:
        return await openai_agent.run_agent(base_url, api_key, task)
    async with (
        openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client,
        aiohttp.ClientSession() as http,
    ):
        while True:
            async with http.get(f"{engine_url['url']}/v1/loads") as reply:
                if sum(load["num_running_reqs"] for load in (await reply.json())["loads"]):
                    break
            await asyncio.sleep(0.002)
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "ping"}], max_tokens=1
        )
    return 1.0


def _agent_threads() -> int:
    return sum(t.name == "slimrl-agent" and t.is_alive() for t in threading.enumerate())


PARK_TRIES = 5
"""Tries at catching the tool call mid-generation: on a loaded machine the call can finish before
the ping's reply ends the rollout (the run is then parked between calls, which
`test_a_call_made_while_parked_waits...` covers); a try that lost that race is run again."""


def _park_and_resume(stack: Stack, data: Path, version: str) -> tuple | None:
    """Rollout 0 parks the example agent's run (over-sampling 2: the ping fills the batch), the
    engine reloads its weights as `version`, the run stays parked past its timeout, rollout 1
    resumes it. None when the tool call had finished before the park."""
    config = _parking_config(
        stack, data, "rollout.over_sampling_batch_size=2", f"rollout.agent_timeout_s={PARKED_S - 1}"
    )
    source, threads = DataSource(config), _agent_threads()
    ctx = RolloutContext(config, stack.tokenizer, stack.endpoint.client)
    mark = stack.mark()
    first = stack.loop.run(run_rollout(ctx, source))
    assert [g[0].label for g in first.groups] == ["ping"] and first.metrics["buffered_groups"] == 1
    ((parked,),) = source.buffer
    assert parked.status == Status.PENDING and parked.metadata["start_rollout_id"] == 0
    assert parked.metadata["agent_run"] in ctx.agents.runs and parked.tokens == []
    reload = requests.post(
        f"{stack.recorder.engine_url}/update_weights_from_disk",
        json={"model_path": str(stack.model), "weight_version": version},
        timeout=120,
    )
    assert reload.status_code == 200 and reload.json()["success"], reload.text
    time.sleep(PARKED_S)
    resumed = dataclasses.replace(ctx, config=_parking_config(stack, data), rollout_id=1)  # no over-sampling
    second = stack.loop.run(run_rollout(resumed, source))
    ((sample,),) = second.groups
    assert sample.index == parked.index and sample.status == Status.COMPLETED
    assert sample.reward == {"score": 1.0, "tool_calls": 1.0}
    # the engine's requests: the tool call aborted after k tokens, continued from them, the answer
    calls = [(i, o) for i, o in stack.recorder.calls[mark:] if i["input_ids"] != _ping_ids(stack)]
    if len(calls) == 2 and calls[0][1]["meta_info"]["finish_reason"]["type"] != "abort":
        stack.loop.run(close_agents(ctx))
        return None
    return ctx, source, threads, config, second, sample, calls, version


def test_partial_rollout_parks_an_agent_run_and_resumes_it_on_new_weights(
    stack: Stack, tmp_path: Path
) -> None:
    """Rollout 0 fills its batch while the example agent's first call (the tool call) is at the
    engine: the run is parked, its call aborted and held, the group buffered. The engine loads the
    weights again as a new version and the run stays parked longer than its agent timeout. Rollout 1
    resumes it: the held call goes on from its prompt + the ids already sampled, and the agent gets
    one reply. The sample is the uninterrupted conversation token for token (greedy, the same
    weights), its tool call one turn of two engine requests whose tokens carry the two versions,
    trained on exactly as sampled, routing equal to Hugging Face's. A run parked when the work
    ends is cancelled: its session closed, its thread gone."""
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in (TASK, PING)))
    engine_url["url"] = stack.recorder.engine_url
    for attempt in range(PARK_TRIES):
        found = _park_and_resume(stack, data, version=str(attempt + 1))
        if found is not None:
            break
    assert found is not None, f"the tool call finished before the park in {PARK_TRIES} tries"
    ctx, source, threads, config, second, sample, calls, new = found
    (p1, aborted), (cont, rest), (p2, answer) = calls
    partial = aborted["output_ids"]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and partial, "parked before any token"
    assert cont["input_ids"] == p1["input_ids"] + partial
    assert cont["sampling_params"]["max_new_tokens"] == openai_agent.MAX_TOKENS - len(partial)
    assert cont["routed_experts_start_len"] == len(cont["input_ids"]) - 1  # the partial's rows kept
    c1 = partial + rest["output_ids"]
    _, tool_call, after_tool, answer_text = _conversation(stack.tokenizer)
    eos = stack.tokenizer.eos_token
    assert stack.tokenizer.decode(c1) == tool_call + eos
    assert stack.tokenizer.decode(sample.tokens) == after_tool + answer_text + eos
    assert (
        sample.tokens == p2["input_ids"] + answer["output_ids"]
        and p2["input_ids"][: len(cont["input_ids"]) + len(rest["output_ids"])]
        == cont["input_ids"] + rest["output_ids"]
    )
    # trained on exactly the sampled tokens, with the engine's logprobs; the tool turn masked
    mask = np.array(sample.loss_mask, dtype=bool)
    c2 = answer["output_ids"]
    assert np.array(sample.response_tokens)[mask].tolist() == c1 + c2
    between = len(p2["input_ids"]) - len(p1["input_ids"]) - len(c1)
    assert mask.tolist() == [True] * len(c1) + [False] * between + [True] * len(c2)
    engine_logprobs = [
        t[0] for out in (aborted, rest, answer) for t in out["meta_info"]["output_token_logprobs"]
    ]
    assert np.array(sample.rollout_log_probs)[mask].tolist() == engine_logprobs
    # the tool call's tokens carry the versions that sampled them: before the park, then the new one
    old = aborted["meta_info"]["weight_version"]
    assert old != new and rest["meta_info"]["weight_version"] == answer["meta_info"]["weight_version"] == new
    assert sample.weight_versions == [old, new, new]
    k = len(partial)
    assert [(s["start"], s["end"], s["versions"]) for s in sample.sampled_spans] == [
        (0, k, [old]),
        (k, len(c1), [new]),
        (len(c1) + between, len(c1) + between + len(c2), [new]),
    ]
    turns = sample.metadata["agent_sequence"]["turns"]
    assert turns[0]["version_spans"] == [[k, [old]], [len(c1) - k, [new]]] and "version_spans" not in turns[1]
    check_sampled(sample, "test")
    np.testing.assert_array_equal(
        np.sort(sample.rollout_routed_experts, -1), np.sort(hf_routing(stack.model, sample.tokens), -1)
    )
    # parked longer than its timeout: the parked time did not count
    info = sample.metadata["agent"]
    assert (
        info["parked"]["times"] == 1
        and info["parked"]["seconds"] >= PARKED_S > config.rollout.agent_timeout_s
    )
    assert sample.metadata["start_rollout_id"] == 0 and "agent_run" not in sample.metadata
    assert not ctx.agents.runs and second.metrics["agent_runs"] == 1.0
    # parked at the work's end: cancelled, nothing left behind
    third = stack.loop.run(run_rollout(dataclasses.replace(ctx, rollout_id=2), source))
    assert third.metrics["buffered_groups"] == 1
    (run,) = ctx.agents.runs.values()
    stack.loop.run(close_agents(ctx))
    assert run.task.done() and run.session.id not in stack.endpoint.sessions
    assert ctx.agents is None
    deadline = time.monotonic() + 10
    while _agent_threads() > threads:
        assert time.monotonic() < deadline, "an agent thread outlived close_agents"
        time.sleep(0.05)


async def _in_loop(fn: Any, *args: Any) -> Any:
    return fn(*args)


def test_a_call_made_while_parked_waits_and_one_whose_agent_hung_up_is_dropped(stack: Stack) -> None:
    """A parked session's new call reaches no engine until the session is resumed, then is answered;
    a held call whose agent hung up meanwhile (its HTTP timeout) is never sent."""
    session = stack.session()
    url = f"{stack.endpoint.base_url(session)}/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    headers = {"Authorization": f"Bearer {stack.endpoint.api_key}"}
    mark = stack.mark()
    stack.loop.run(_in_loop(session.park))
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(url, json=body, headers=headers, timeout=0.5)  # the agent gives up
    waiting = Background(lambda: requests.post(url, json=body, headers=headers, timeout=60))
    time.sleep(0.5)
    assert stack.mark() == mark and not session.turns  # both held
    stack.loop.run(_in_loop(session.resume, "resumed-"))
    reply = waiting.join()
    assert reply.status_code == 200, reply.text
    ((request, answer),) = stack.recorder.calls[mark:]  # the hung-up call was dropped
    assert request["rid"].startswith("resumed-") and len(session.turns) == 1
    assert reply.json()["usage"]["completion_tokens"] == len(answer["output_ids"])


class Background:
    """A blocking call on a thread of its own."""

    def __init__(self, fn: Any) -> None:
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Any) -> None:
        self.result = fn()

    def join(self, timeout: float = 60) -> Any:
        self.thread.join(timeout)
        return self.result


async def _sleeper(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


def test_the_agent_timeout_counts_only_the_time_a_run_is_not_parked() -> None:
    """A run parked for 0.9 s of its 1 s outlives a 0.5 s timeout; the same run never parked does not."""

    async def main() -> tuple[Any, float, float, Any]:
        clock = RunClock(0.5)
        clock.pause()
        asyncio.get_running_loop().call_later(0.9, clock.resume)
        parked = await run_in_own_loop(_sleeper, (1.0,), clock, asyncio.Event())
        left = clock.left_s()
        running = await run_in_own_loop(_sleeper, (1.0,), RunClock(0.5), asyncio.Event())
        return parked, clock.parked_s, left, running

    parked, parked_s, left, running = asyncio.run(main())
    assert parked == ("returned", "done") and running == ("timeout", None)
    assert parked_s >= 0.9 and 0 < left < 0.5


def _parking_config(stack: Stack, data: Path, *overrides: str) -> Any:
    """One group per batch, one run per group (REINFORCE++: no group baseline), greedy, routing
    replay, partial rollout."""
    return load_config(None, [
        f"model.hf_checkpoint={stack.model}", f"data.prompt_data={data}", "cluster.gpus_per_node=1",
        f"rollout.agent_function_path={__name__}.parking_agent", "rollout.partial_rollout=true",
        "rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=1", "rollout.sampling.temperature=0",
        "algorithm.routing_replay=true", "algorithm.advantage_estimator=reinforce_plus_plus", *overrides,
    ])  # fmt: skip


def _ping_ids(stack: Stack) -> list[int]:
    messages = [{"role": "user", "content": "ping"}]
    return stack.tokenizer.encode(
        stack.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rollout.custom_generate_function_path=examples.multi_turn_tool_generate.generate"], "generates"),
        (["rollout.custom_rm_path=examples.custom_reward.reward"], "returns the reward"),
        (["rollout.agent_tool_call_parser=nosuch"], "not one of SGLang's tool-call parsers"),
        (["rollout.agent_function_path=tests.test_agent_endpoint.sync_agent"], "must be an `async def`"),
        (
            ["rollout.agent_function_path=tests.test_agent_endpoint.two_param_agent"],
            "f(base_url, api_key, task)",
        ),
    ],
    ids=["custom-generate", "custom-rm", "parser", "sync", "signature"],
)
def test_the_config_refuses_what_an_agent_cannot_run_with(
    tiny_model, overrides: list[str], needle: str
) -> None:
    agent = "rollout.agent_function_path=examples.openai_agent.run_agent"
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.hf_checkpoint={tiny_model('qwen3_moe')}", agent, *overrides])
    assert needle in str(info.value) and "\n" not in str(info.value)


def sync_agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    return 1.0


async def two_param_agent(base_url: str, api_key: str) -> float:
    return 1.0


ASYNC = ["cluster.colocate=false", "cluster.rollout_gpus=1", "algorithm.async_staleness=1"]
LAYOUTS = {
    "colocated": ["cluster.gpus_per_node=1"],
    "disaggregated_async": ASYNC,  # the next rollout's agents run while the trainer updates
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_training_run_trains_the_agent_on_policy_through_the_rollout_manager(
    tool_model: Path, tmp_path: Path, layout: str
) -> None:
    """`slimrl train` with `rollout.agent_function_path`: the endpoint runs in the rollout manager's
    event loop under Ray, one engine and one trainer rank, colocated or on their own slots with the
    next rollout generated during the update; every agent run is a two-call tool conversation
    scored 1, and the trainer's logprobs of the merged samples (tool results masked) equal the
    engine's before any update: on-policy through the agent path."""
    from tests.test_rl_e2e import command, rows

    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"prompt": TASK["prompt"], "label": TASK["label"]}) + "\n")
    cmd = command(
        tmp_path, "agent", tool_model, data, "rollout.agent_function_path=examples.openai_agent.run_agent",
        "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "train.num_steps=2",
        "train.max_seq_len=1024", "rollout.num_engines=1", "parallel.ep=1", "logging.tensorboard=false",
        "checkpoint.save_interval=null", *LAYOUTS[layout],
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    metrics = rows(tmp_path / "agent")
    assert [r["step"] for r in metrics] == [1, 2]
    for r in metrics:
        assert r["rollout/agent_runs"] == 4.0 and r["rollout/agent_splits"] == 0.0
        assert r["rollout/raw_reward"] == 1.0 and r["rollout/samples"] == 4.0
    assert metrics[0]["train/train_rollout_logprob_abs_diff"] < 1e-5  # before any update: exact
    records = [json.loads(line) for line in (tmp_path / "agent" / "rollout_samples.jsonl").open()]
    assert len(records) == 8 and {r["split"] for r in records} == {"train"}
    for record in records:
        assert record["metadata"]["agent"]["calls"] == 2 and 0 in record["loss_mask"]
    # staleness per sample: the weight version of every call the agent made (one each here), and
    # the step's lag from the oldest. Colocated, rollout 1 runs on the update of step 1; async, it
    # ran while the trainer made that update (version 0, or 1 for calls made after the sync).
    newest = {"colocated": {"1"}, "disaggregated_async": {"0", "1"}}[layout]
    for record in records:
        versions = record["weight_versions"]
        assert len(versions) == 2 and set(versions) <= ({"0"} if record["rollout_id"] == 0 else newest)
    for step, r in enumerate(metrics):
        oldest = min(int(v) for rec in records if rec["rollout_id"] == step for v in rec["weight_versions"])
        assert r["rollout/weight_version_lag"] == step - oldest
