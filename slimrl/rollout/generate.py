"""The default `generate()`: one turn, prompt in, response tokens and their logprobs out.

A custom generate (`rollout.custom_generate_function_path`) has the same signature:

    async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict) -> Sample | list[Sample]

It fills `tokens`, `response_length`, `loss_mask`, `rollout_log_probs` (one entry per response
token) and `status`; the reward is computed after it returns. `ctx.client.generate(...)` returns
SGLang's `/generate` response dict. `apply_response` does the bookkeeping for one engine turn.

MoE routing replay (`algorithm.routing_replay`): pass `**ctx.routing_request(sample)` to each
`ctx.client.generate` call and `routing=ctx.routing` to `apply_response`; the sample then holds
one routing row per token of its sequence (tool tokens included: their rows come with the next
engine call). A hook that appends a turn by itself calls `routing.append_routing` instead.
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.data.prompts import render_prompt
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.rollout.client import FleetClient
from slimrl.rollout.routing import RoutingLayout, append_routing, routing_request
from slimrl.sample import Sample, Status
from slimrl.sampled import record_span

_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


EVALUATING: ContextVar[bool] = ContextVar("slimrl_evaluating", default=False)
"""Set by the rollout for an evaluation's tasks: eval samples are never trained on, so they do not
ask for routed experts (which would cost bytes and bypass the router)."""

PROMPT_CACHE_SIZE = 4096
"""Rendered prompts kept per context: the samples of a group share one prompt, so a rollout
tokenizes each prompt once instead of `n_samples_per_prompt` times (transformers' `encode` costs
about as much CPU as the whole HTTP request of a one-token answer)."""


@dataclass
class RolloutContext:
    """What hooks get: the config, the HF tokenizer and the fleet client."""

    config: SlimConfig
    tokenizer: Any
    client: FleetClient
    rollout_id: int = 0
    agents: Any = field(default=None, repr=False)
    """`rollout.agent.runner.Agents`: the endpoint of agent runs (started by the first one) and the
    runs in it, running or parked between rollouts (partial rollout)."""
    _prompt_ids: OrderedDict[str, list[int]] = field(default_factory=OrderedDict, repr=False)

    def prompt_ids(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """`render_prompt` under the config's chat-template setting, memoised for text prompts
        (a fresh list each call: callers own it)."""
        apply_template = self.config.data.apply_chat_template
        if not isinstance(prompt, str):
            return render_prompt(self.tokenizer, prompt, apply_template)
        ids = self._prompt_ids.get(prompt)
        if ids is None:
            ids = render_prompt(self.tokenizer, prompt, apply_template)
            self._prompt_ids[prompt] = ids
            if len(self._prompt_ids) > PROMPT_CACHE_SIZE:
                self._prompt_ids.popitem(last=False)
        else:
            self._prompt_ids.move_to_end(prompt)
        return list(ids)

    @cached_property
    def replay_layout(self) -> RoutingLayout | None:
        """The routing every training sample must carry; None without `algorithm.routing_replay`."""
        if not self.config.algorithm.routing_replay:
            return None
        return RoutingLayout.of(read_model_arch(self.config.model.hf_checkpoint, self.config.model.overrides))

    @property
    def routing(self) -> RoutingLayout | None:
        """`replay_layout` while generating training samples; None in an evaluation."""
        return None if EVALUATING.get() else self.replay_layout

    def routing_request(self, sample: Sample) -> dict[str, Any]:
        """Extra `/generate` fields for `sample`'s next engine call: the routing rows it lacks when
        replay is on, nothing otherwise."""
        return {} if self.routing is None else routing_request(sample)


def sampling_params_for(config: SlimConfig, evaluation: bool = False) -> dict[str, Any]:
    sampling = config.eval.sampling if evaluation else config.rollout.sampling
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,
        # Keep the stop token in output_ids: the trainer must see exactly what was sampled.
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params


def apply_response(
    sample: Sample, response: dict[str, Any], loss_mask_value: int = 1, routing: RoutingLayout | None = None
) -> list[int]:
    """Append one engine turn to the sample; returns the new token ids. With `routing`
    (`ctx.routing`), the turn's routed experts are appended too."""
    meta = response.get("meta_info", {})
    triples = meta.get("output_token_logprobs") or []
    new_tokens = [int(t[1]) for t in triples] if triples else list(response.get("output_ids", []))
    logprobs = [float(t[0]) for t in triples] if triples else [0.0] * len(new_tokens)
    previous_mask = sample.effective_loss_mask()
    versions = turn_weight_versions(meta)
    record_span(sample, sample.response_length, new_tokens, versions)
    sample.tokens = [*sample.tokens, *new_tokens]
    sample.response_length += len(new_tokens)
    sample.response += response.get("text", "")
    sample.loss_mask = [*previous_mask, *([loss_mask_value] * len(new_tokens))]
    sample.rollout_log_probs = [*(sample.rollout_log_probs or []), *logprobs]
    sample.status = _FINISH_STATUS.get((meta.get("finish_reason") or {}).get("type", "abort"), Status.ABORTED)
    sample.weight_versions.extend(versions)
    if routing is not None:
        append_routing(sample, response, routing)
    return new_tokens


def turn_weight_versions(meta: dict[str, Any]) -> list[str]:
    """The weight versions one engine turn was generated under, oldest first.

    SGLang 0.5.23 sends `weight_versions`, one `{version, start, end}` span per version when an
    update landed mid-request (its `weight_version` is only the last); older servers send only
    `weight_version`. Recording every version keeps the rollout's oldest version right."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans:
        return [str(span["version"]) for span in spans if isinstance(span, dict) and "version" in span]
    version = meta.get("weight_version")
    return [] if version is None else [str(version)]


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Single-turn generation; continues a partial sample (partial rollout) where it stopped."""
    if not sample.tokens:
        sample.tokens = ctx.prompt_ids(sample.prompt)
    params = dict(sampling_params)
    params["max_new_tokens"] = max(0, params["max_new_tokens"] - sample.response_length)
    if params["max_new_tokens"] == 0:
        sample.status = Status.TRUNCATED
        return sample
    response = await ctx.client.generate(
        input_ids=sample.tokens,
        sampling_params=params,
        return_logprob=True,
        rid=sample.metadata.get("rid"),
        **ctx.routing_request(sample),
    )
    apply_response(sample, response, routing=ctx.routing)
    return sample
