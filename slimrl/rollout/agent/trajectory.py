"""Token-in/token-out trajectories: every call an agent made, as the engine saw and sampled it, and
the training samples built from them.

A `Turn` is one completion of one call (a call with `n` choices has `n` turns): the exact prompt
ids sent to the engine, the ids the engine returned (`output_ids`), their logprobs, the finish
reason, the weight versions and, under routing replay, the routed experts. A call parked at a
rollout's end (partial rollout) and continued by the next one is still one turn (`joined`): its
completion comes from two engine requests, each token recorded with the weight version that
sampled it (`version_spans`).

**Merging.** Turns are taken in call order. A turn whose prompt ids start with all the ids of an
earlier sequence (prompt + completions + what came between) extends it: the ids between (template,
tool results, user turns) go in with `loss_mask` 0 and logprob 0.0, the completion with `loss_mask`
1 and the engine's logprobs. A turn that extends no sequence starts a new sample, and the split is
reported with its reason: another choice of a call with `n` > 1, a branch from a turn another call
already continued, or a prompt that is not an extension at all (the agent edited the history).
Nothing is re-tokenised: every id of a sample is an id the engine was fed or sampled.

**The check** (`check_sequence`): every token trained on (loss mask 1) is a token the engine
returned for that position, with the logprob it returned, and every turn's prompt and completion
lie in the sample where the merge put them; a failure is a bug, one line naming the call.
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slimrl.errors import SlimError
from slimrl.rollout.generate import turn_weight_versions
from slimrl.rollout.routing import RoutingLayout, decode_routed_experts
from slimrl.sample import Sample, Status
from slimrl.sampled import record_span

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class Turn:
    call: int
    """The session's call number, in the order the calls arrived."""
    choice: int
    prompt_ids: list[int]
    completion_ids: list[int]
    """`output_ids` exactly as the engine returned them."""
    logprobs: list[float]
    finish_reason: str
    """The engine's: `stop`, `length` or `abort`."""
    matched: int | str | None = None
    """What a `stop` matched: a stop token id (the last completion id) or a stop string."""
    weight_versions: list[str] = field(default_factory=list)
    version_spans: list[tuple[int, list[str]]] = field(default_factory=list)
    """(completion tokens, weight versions) of each engine request the completion came from, in
    order: one, unless the call was parked at a rollout's end and continued on new weights."""
    routing: str | None = None
    """`meta_info.routed_experts` as returned (base64 int32), rows from `routing_start` on."""
    routing_start: int = 0
    top_logprobs: list[Any] | None = None
    """`meta_info.output_top_logprobs` when asked: per token, `[logprob, id, text]` alternatives."""
    malformed_tool_call: bool = False
    """The completion opened a tool call that the tool-call parser could not read."""

    @property
    def ids(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]

    def record(self) -> dict[str, Any]:
        """What the sample log keeps of the turn."""
        record = {
            "call": self.call,
            "choice": self.choice,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.completion_ids),
            "finish_reason": self.finish_reason,
        }
        if self.malformed_tool_call:
            record["malformed_tool_call"] = True
        if len(self.version_spans) > 1:  # continued after a park: tokens per weight version
            record["version_spans"] = [[n, list(v)] for n, v in self.version_spans]
        return record


def turn_from_response(
    call: int, choice: int, prompt_ids: list[int], response: dict[str, Any], start: int
) -> Turn:
    """One engine answer as a turn; the ids and the logprob triples must agree."""
    meta = response.get("meta_info", {})
    ids = [int(t) for t in response.get("output_ids", [])]
    triples = meta.get("output_token_logprobs") or []
    finish = meta.get("finish_reason") or {}
    if [int(t[1]) for t in triples] != ids:
        raise SlimError(
            f"call {call}: the engine's output_ids and output_token_logprobs name different tokens "
            f"({len(ids)} ids, {len(triples)} logprobs)"
        )
    versions = turn_weight_versions(meta)
    return Turn(
        call=call,
        choice=choice,
        prompt_ids=list(prompt_ids),
        completion_ids=ids,
        logprobs=[float(t[0]) for t in triples],
        finish_reason=finish.get("type", "abort"),
        matched=finish.get("matched") if isinstance(finish.get("matched"), int | str) else None,
        weight_versions=versions,
        version_spans=[(len(ids), versions)],
        routing=meta.get("routed_experts"),
        routing_start=start,
        top_logprobs=meta.get("output_top_logprobs"),
    )


def joined(partial: Turn, rest: Turn) -> Turn:
    """One turn from a call aborted at a rollout's end (`partial`) and its continuation (`rest`,
    whose prompt is the partial turn's prompt + completion): the completion is both, each part with
    its own weight versions. The routed experts: the partial turn's rows and then the rest's when
    the continuation asked from the partial's last token on (the partial's rows covered every token
    it fed), else the rest's alone (it asked again from the partial's start)."""
    if rest.prompt_ids != partial.ids:
        raise SlimError(f"call {partial.call}: a continuation must be fed the partial turn's ids")
    routing, start = rest.routing, rest.routing_start
    stitched = rest.routing_start > partial.routing_start
    if stitched and partial.routing is not None and rest.routing is not None:
        raw = base64.b64decode(partial.routing) + base64.b64decode(rest.routing)
        routing = base64.b64encode(raw).decode()
        start = partial.routing_start
    spans = [span for span in (*partial.version_spans, *rest.version_spans) if span[0]] or rest.version_spans
    tops = None
    if partial.top_logprobs is not None and rest.top_logprobs is not None:
        tops = [*partial.top_logprobs, *rest.top_logprobs]
    return Turn(
        call=partial.call,
        choice=partial.choice,
        prompt_ids=list(partial.prompt_ids),
        completion_ids=[*partial.completion_ids, *rest.completion_ids],
        logprobs=[*partial.logprobs, *rest.logprobs],
        finish_reason=rest.finish_reason,
        matched=rest.matched,
        weight_versions=[v for _, versions in spans for v in versions],
        version_spans=spans,
        routing=routing,
        routing_start=start,
        top_logprobs=tops,
    )


@dataclass
class _Sequence:
    sample: Sample
    turns: list[Turn] = field(default_factory=list)
    problem: str | None = None
    """Why the sample cannot be trained on (routing rows it cannot have); it becomes failed."""


def build_samples(
    turns: list[Turn], base: Sample, routing: RoutingLayout | None = None
) -> tuple[list[Sample], list[dict[str, Any]]]:
    """The training samples of a session's turns (see the module docstring) and its splits, one
    `{"call", "choice", "reason"}` per turn that started a sample after the first."""
    sequences: list[_Sequence] = []
    splits: list[dict[str, Any]] = []
    for turn in sorted(turns, key=lambda t: (t.call, t.choice)):
        prefix = [s for s in sequences if _is_prefix(s.sample.tokens, turn.prompt_ids)]
        target = max(prefix, key=lambda s: len(s.sample.tokens), default=None)
        if target is None:
            if sequences:
                splits.append(
                    {"call": turn.call, "choice": turn.choice, "reason": _why_split(turn, sequences)}
                )
            target = _Sequence(_fresh(base, turn.prompt_ids))
            sequences.append(target)
        _append(target, turn, routing)
    for sequence in sequences:
        check_sequence(sequence.sample, sequence.turns)
    samples = []
    for number, sequence in enumerate(sequences):
        sample = sequence.sample
        sample.status = FINISH_STATUS.get(sequence.turns[-1].finish_reason, Status.ABORTED)
        if sequence.problem is not None:
            sample.status = Status.FAILED
            sample.metadata["failure"] = sequence.problem
        sample.metadata["agent_sequence"] = {
            "index": number,
            "of": len(sequences),
            "turns": [t.record() for t in sequence.turns],
        }
        samples.append(sample)
    return samples, splits


def _is_prefix(head: list[int], ids: list[int]) -> bool:
    return len(head) <= len(ids) and ids[: len(head)] == head


def _fresh(base: Sample, prompt_ids: list[int]) -> Sample:
    sample = copy.deepcopy(base)
    sample.tokens = list(prompt_ids)
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.weight_versions, sample.sampled_spans = [], []
    sample.rollout_routed_experts = None
    sample.reward = None
    return sample


def _why_split(turn: Turn, sequences: list[_Sequence]) -> str:
    earlier = [t for s in sequences for t in s.turns]
    if any(t.call == turn.call for t in earlier):
        return f"choice {turn.choice} of call {turn.call} (n > 1): a sample of its own"
    for t in earlier:
        if _is_prefix(t.ids, turn.prompt_ids):
            return f"branches from call {t.call} choice {t.choice}, which a later call already continued"
    return (
        "its prompt does not extend any earlier call's prompt + completion (the agent edited or "
        "reordered the history, or the template re-renders it): a sample of its own"
    )


def _append(sequence: _Sequence, turn: Turn, layout: RoutingLayout | None) -> None:
    sample = sequence.sample
    held = len(sample.tokens)
    between = turn.prompt_ids[held:]
    start = sample.response_length + len(between)
    at = 0
    spans = turn.version_spans or [(len(turn.completion_ids), turn.weight_versions)]
    for count, versions in spans:  # one span per engine request, with its versions
        record_span(sample, start + at, turn.completion_ids[at : at + count], versions)
        at += count
    sample.tokens = [*sample.tokens, *between, *turn.completion_ids]
    sample.response_length = start + len(turn.completion_ids)
    sample.loss_mask = [*(sample.loss_mask or []), *[0] * len(between), *[1] * len(turn.completion_ids)]
    sample.rollout_log_probs = [*(sample.rollout_log_probs or []), *[0.0] * len(between), *turn.logprobs]
    sample.weight_versions.extend(turn.weight_versions)
    sequence.turns.append(turn)
    if layout is not None and sequence.problem is None:
        _stitch_routing(sequence, turn, held, layout)


def _stitch_routing(sequence: _Sequence, turn: Turn, held: int, layout: RoutingLayout) -> None:
    """Rows for the tokens the sample gained: the turn's rows from row `held - 1` on (the previous
    turn's last token was never fed; its row comes with this call). Rows already held are kept."""
    sample = sequence.sample
    have = 0 if sample.rollout_routed_experts is None else len(sample.rollout_routed_experts)
    first = max(held - 1, 0) if have else 0
    if turn.routing is None or turn.routing_start > first:
        sequence.problem = (
            f"call {turn.call} choice {turn.choice}: the engine returned routed experts from token "
            f"{turn.routing_start} ({'none' if turn.routing is None else 'some'}); this sample needs them "
            f"from token {first}"
        )
        return
    rows = len(turn.ids) - 1 - turn.routing_start
    who = f"agent call {turn.call} choice {turn.choice}"
    new = decode_routed_experts(turn.routing, rows, layout, who)[first - turn.routing_start :]
    old = sample.rollout_routed_experts
    sample.rollout_routed_experts = new if old is None else np.concatenate([old[:first], new])


def check_sequence(sample: Sample, turns: list[Turn]) -> None:
    """Every trained token is one the engine sampled there, with its logprob; every turn's prompt
    and completion are where the merge put them. A mismatch is a bug in the merge: one line."""
    prompt = len(sample.tokens) - sample.response_length
    mask = np.asarray(sample.loss_mask or [], dtype=bool)
    expected = np.zeros(sample.response_length, dtype=bool)
    for turn in turns:
        who = f"agent trajectory, call {turn.call} choice {turn.choice}"
        end = len(turn.prompt_ids) + len(turn.completion_ids)
        if sample.tokens[: len(turn.prompt_ids)] != turn.prompt_ids:
            raise SlimError(f"{who}: the sample does not start with the prompt the engine was fed")
        if sample.tokens[len(turn.prompt_ids) : end] != turn.completion_ids:
            raise SlimError(f"{who}: the sample's tokens there are not the ones the engine returned")
        first = len(turn.prompt_ids) - prompt
        logprobs = (sample.rollout_log_probs or [])[first : end - prompt]
        if logprobs != turn.logprobs:
            raise SlimError(f"{who}: the sample's logprobs there are not the engine's")
        expected[first : end - prompt] = True
    if mask.shape != expected.shape or (mask != expected).any():
        raise SlimError(
            "agent trajectory: the loss mask is 1 exactly on the sampled tokens no longer "
            f"(sample {sample.index}, {int(mask.sum())} trained, {int(expected.sum())} sampled)"
        )
