"""Routed experts for MoE routing replay: from the engines' answer into `Sample.rollout_routed_experts`.

Asked with `return_routed_experts: true`, both engines put `meta_info.routed_experts` in their
`/generate` answer: base64 of a little-endian int32 array [rows, layers, top_k] with one row per
token that went through the model from `routed_experts_start_len` on (prompt + completion - 1
rows from 0: the last sampled token is never fed). A sample keeps them as one array
(len(tokens) - 1, MoE layers, top_k) in the smallest unsigned dtype holding the expert ids.

Turns stitch: each request asks only for the rows the sample does not hold yet
(`routed_experts_start_len` = rows held), so a multi-turn hook or a continued partial sample gets,
on its next engine call, the rows of its tool tokens and of the last token of the previous turn
(which that turn never fed), and no row twice. Rows already held are kept: they are the routing
under which those tokens' rollout logprobs were computed.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from slimrl.errors import SlimError
from slimrl.model_arch import ModelArch
from slimrl.sample import Sample, invalid_expert_id


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned dtype holding ids 0..num_experts-1 (uint8 up to 256 experts)."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"{num_experts} experts")


@dataclass(frozen=True, slots=True)
class RoutingLayout:
    """What a sample's routing must look like for this model."""

    num_layers: int
    moe_layers: tuple[int, ...]
    """0-based indexes of the MoE layers (all layers for Qwen3-MoE; DeepSeek-V3 starts dense)."""
    top_k: int
    num_experts: int

    @classmethod
    def of(cls, arch: ModelArch) -> RoutingLayout:
        assert arch.num_experts, "a dense model has no routing"
        pattern = arch.moe_layer_pattern or (1,) * arch.num_layers
        moe = tuple(layer for layer, is_moe in enumerate(pattern) if is_moe)
        return cls(arch.num_layers, moe, arch.moe_topk, arch.num_experts)

    @property
    def dtype(self) -> np.dtype:
        return routing_dtype(self.num_experts)

    def shape(self, tokens: int) -> tuple[int, int, int]:
        """The routing shape of a sequence of `tokens` tokens."""
        return (max(tokens - 1, 0), len(self.moe_layers), self.top_k)

    def fits(self, ids: int, rows: int) -> bool:
        """Whether `ids` wire values are `rows` rows (one column per decoder layer or per MoE layer)."""
        return ids in (rows * self.num_layers * self.top_k, rows * len(self.moe_layers) * self.top_k)

    def bytes_per_token(self) -> int:
        return len(self.moe_layers) * self.top_k * self.dtype.itemsize


def routed_rows(sample: Sample) -> int:
    """Rows of routing the sample holds (0 when it holds none)."""
    routing = sample.rollout_routed_experts
    return 0 if routing is None else len(routing)


def routing_request(sample: Sample) -> dict[str, Any]:
    """Extra `/generate` fields asking for the routing rows `sample` does not hold yet."""
    return {"return_routed_experts": True, "routed_experts_start_len": routed_rows(sample)}


def append_routing(sample: Sample, response: dict[str, Any], layout: RoutingLayout) -> None:
    """Append one engine turn's routing to `sample`, whose `tokens` already end with that turn's
    output (call it after the turn's tokens were appended, e.g. by `apply_response`).

    The request must have been made with `routing_request(sample)` before the turn (start =
    rows held). An answer without routing (an engine launched without routed experts) leaves the
    sample short; `check_sample` refuses it once the sample is finished. So does an aborted turn
    whose routing does not cover its tokens (aborted before its prefill ran): a continuation asks
    for those rows again."""
    meta = response.get("meta_info", {})
    encoded = meta.get("routed_experts")
    if encoded is None:
        return
    held = routed_rows(sample)
    rows = max(len(sample.tokens) - 1 - held, 0)
    aborted = (meta.get("finish_reason") or {}).get("type") == "abort"
    if aborted and not layout.fits(len(base64.b64decode(encoded)) // 4, rows):
        return
    new = decode_routed_experts(encoded, rows, layout, f"sample {sample.index} (group {sample.group_index})")
    old = sample.rollout_routed_experts
    sample.rollout_routed_experts = new if old is None or not held else np.concatenate([old, new])


def decode_routed_experts(encoded: str, rows: int, layout: RoutingLayout, who: str) -> np.ndarray:
    """`meta_info.routed_experts` of `rows` tokens -> (rows, MoE layers, top_k) in `layout.dtype`.

    SGLang sends one column per decoder layer (dense layers' entries unused), the embedded engine one
    per MoE layer; both become MoE layers only. Anything else (another model's routing, rows that do
    not match the tokens) is one line naming `who`."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    moe, k = len(layout.moe_layers), layout.top_k
    if rows and flat.size == rows * layout.num_layers * k:
        array = flat.reshape(rows, layout.num_layers, k)[:, list(layout.moe_layers)]
    elif flat.size == rows * moe * k:
        array = flat.reshape(rows, moe, k)
    else:
        raise SlimError(
            f"{who}: the engine returned {flat.size} routed-expert ids for {rows} new tokens; expected "
            f"{rows} x {moe} MoE layers x top-{k} = {rows * moe * k} (routing from another model?)"
        )
    if (bad := invalid_expert_id(array, layout.num_experts)) is not None:
        raise SlimError(
            f"{who}: the engine returned expert id {bad}; the model has {layout.num_experts} experts "
            "(routing from another model?)"
        )
    return array.astype(layout.dtype)
