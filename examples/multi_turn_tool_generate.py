"""A multi-turn tool-calling `generate()` (set `rollout.custom_generate_function_path:
examples.multi_turn_tool_generate.generate`).

The model talks; when its turn contains `<calc>EXPR</calc>` the environment evaluates EXPR and
answers with `<result>VALUE</result>`; otherwise it answers with a hint. Environment tokens are part
of the sequence the model conditions on, but they were not sampled by the policy: they get
`loss_mask` 0 (never trained on) and a rollout logprob of 0.0 (ignored by the loss). With
`algorithm.routing_replay` every token still gets its routed experts: each engine call asks for the
rows the sample lacks (`ctx.routing_request`), which include the tool tokens fed in that call.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from slimrl.data.prompts import render_prompt
from slimrl.rollout.generate import RolloutContext, apply_response
from slimrl.sample import Sample, Status

MAX_TURNS = 3
TURN_TOKENS = 8
CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """A tiny safe calculator: integers, + - * and parentheses."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("unsupported")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (ValueError, SyntaxError):
        return "error"


def observation(turn_text: str, sample: Sample) -> str:
    found = CALL.search(turn_text)
    if found:
        return f"<result>{calculate(found.group(1))}</result>"
    prompt = sample.prompt if isinstance(sample.prompt, str) else ""
    return f"<hint>{calculate(prompt.rstrip('='))}</hint>"


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Up to MAX_TURNS model turns of TURN_TOKENS tokens, each followed by a tool observation.

    The whole response (model and tool tokens) stays within `max_new_tokens`; it ends with a model
    turn, never with an observation the model did not get to answer.
    """
    if not sample.tokens:
        sample.tokens = render_prompt(ctx.tokenizer, sample.prompt, ctx.config.data.apply_chat_template)
    budget = sampling_params["max_new_tokens"]
    for turn in range(MAX_TURNS):
        room = budget - sample.response_length
        if room <= 0:
            sample.status = Status.TRUNCATED
            break
        params = {**sampling_params, "max_new_tokens": min(TURN_TOKENS, room)}
        # No rid: the client derives one from the rollout's prefix, so a rollout abort reaches us.
        response = await ctx.client.generate(
            input_ids=sample.tokens,
            sampling_params=params,
            return_logprob=True,
            **ctx.routing_request(sample),
        )
        apply_response(sample, response, routing=ctx.routing)
        if sample.status in (Status.ABORTED, Status.FAILED):
            break
        if sample.tokens[-1] == ctx.tokenizer.eos_token_id:
            sample.status = Status.COMPLETED  # the model ended the conversation (even on its last token)
            break
        if turn == MAX_TURNS - 1:
            break
        tool_text = observation(response.get("text", ""), sample)
        tool_ids = ctx.tokenizer.encode(tool_text, add_special_tokens=False)
        if sample.response_length + len(tool_ids) >= budget:
            sample.status = Status.TRUNCATED  # no room left for the model to answer the tool
            break
        append_tool_output(sample, tool_ids, tool_text)
    return sample


def append_tool_output(sample: Sample, tool_ids: list[int], tool_text: str) -> None:
    """Environment tokens: in the sequence, but loss_mask 0 and logprob 0.0 (not trained on)."""
    previous_mask = sample.effective_loss_mask()
    sample.tokens = [*sample.tokens, *tool_ids]
    sample.response_length += len(tool_ids)
    sample.response += tool_text
    sample.loss_mask = [*previous_mask, *[0] * len(tool_ids)]
    sample.rollout_log_probs = [*(sample.rollout_log_probs or []), *[0.0] * len(tool_ids)]
    sample.metadata["tool_turns"] = sample.metadata.get("tool_turns", 0) + 1
