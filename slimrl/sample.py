"""`Sample`: the one data contract between rollout and training.

A sample is one response to one prompt. `tokens` holds prompt and response together; the last
`response_length` of them are the response, and `loss_mask` / `rollout_log_probs` have one entry
per response token. Field names follow slime's where the meaning is the same, so hooks written
for it read naturally here.

Example (a two-turn tool call: the tool's output is in the response but not trained on):

    tokens           = [p0, p1, p2,  r0, r1,  t0, t1,  r2, eos]
    response_length  = 6
    loss_mask        =              [1,  1,   0,  0,   1,  1]
    rollout_log_probs=              [-.1,-.3, 0., 0., -.2,-.05]
"""

from __future__ import annotations

import base64
import copy
import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np


class Status(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def invalid_expert_id(routing: np.ndarray, num_experts: int) -> int | None:
    """The first-found id outside 0..num_experts-1 in a routing array (its minimum if negative, else
    its maximum), or None when every id is valid: what the engine, hook and trainer checks report."""
    if not routing.size:
        return None
    low, high = int(routing.min()), int(routing.max())
    if low < 0:
        return low
    return high if high >= num_experts else None


@dataclass(kw_only=True)
class Sample:
    group_index: int = 0
    """Which prompt group of the rollout batch the sample belongs to."""
    index: int = 0
    """Global sample index in the rollout (unique within a rollout)."""
    prompt: str | list[dict[str, Any]] = ""
    """Prompt text, or chat messages before the template is applied."""
    tokens: list[int] = field(default_factory=list)
    """Prompt tokens followed by response tokens."""
    response: str = ""
    response_length: int = 0
    label: Any = None
    """Reference answer for rule-based rewards."""
    reward: float | dict[str, float] | None = None
    loss_mask: list[int] | None = None
    """Per response token: 1 trains on it, 0 does not (tool output, padding). None means all ones."""
    rollout_log_probs: list[float] | None = None
    """Per response token: logprob reported by the inference engine that sampled it."""
    status: Status = Status.PENDING
    weight_versions: list[str] = field(default_factory=list)
    """Engine weight version(s) the response was generated under."""
    metadata: dict[str, Any] = field(default_factory=dict)
    rollout_routed_experts: np.ndarray | None = None
    """MoE routing replay (`algorithm.routing_replay`): the experts the engine routed each token to,
    shape (len(tokens) - 1, MoE layers, top_k), in the smallest unsigned dtype holding the expert ids
    (uint8 up to 256 experts). Row i is token i's routing in every MoE layer, whatever its loss mask;
    the last token was never fed to the model, so it has no row. None: not returned (replay off)."""
    sampled_spans: list[dict[str, Any]] = field(default_factory=list)
    """What the engines produced (`slimrl/sampled.py`): per engine turn, its response positions
    `[start, end)`, a digest of its token ids and its weight version(s). Checked after every stage
    and before training: tokens rewritten after sampling, or trained on without being sampled, are
    refused."""
    remove_sample: bool = False
    """Set by a filter to keep the sample out of training: its loss mask becomes all zeros
    (`train_loss_mask`), so it adds nothing to the loss or to the token and sequence counts that
    normalise it. It still counts in metrics and in its group's reward statistics (advantages)."""

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.response_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def effective_loss_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * self.response_length

    def train_loss_mask(self) -> list[int]:
        """The loss mask the trainer gets: all zeros when `remove_sample` is set."""
        return [0] * self.response_length if self.remove_sample else self.effective_loss_mask()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the partial-rollout buffer in a checkpoint); the routing array becomes
        `encode_array`'s compact form, not nested lists."""
        data = {
            f.name: copy.deepcopy(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name != "rollout_routed_experts"
        }
        data["status"] = self.status.value
        routing = self.rollout_routed_experts
        data["rollout_routed_experts"] = None if routing is None else encode_array(np.asarray(routing))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["status"] = Status(values.get("status", Status.PENDING))
        if isinstance(values.get("rollout_routed_experts"), dict):
            values["rollout_routed_experts"] = decode_array(values["rollout_routed_experts"])
        return cls(**values)


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """An array as JSON: dtype, shape and base64 of its little-endian bytes (4/3 of the raw size)."""
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    data = base64.b64encode(np.ascontiguousarray(little).tobytes()).decode("ascii")
    return {"dtype": array.dtype.name, "shape": list(array.shape), "b64": data}


def decode_array(encoded: dict[str, Any]) -> np.ndarray:
    """The inverse of `encode_array` (a writable array of the native byte order)."""
    dtype = np.dtype(encoded["dtype"]).newbyteorder("<")
    raw = np.frombuffer(base64.b64decode(encoded["b64"]), dtype=dtype)
    return raw.reshape(encoded["shape"]).astype(dtype.newbyteorder("="))
