"""Per-tensor rules between Hugging Face and Megatron-Core (the transforms they name are in
`transforms.py`, which imports torch: config loading and `--dry-run` read the rules without it).

A rule names one Megatron tensor (canonical name: local layer spec, global layer index, global
expert id) and the HF tensor(s) it is made of, plus a *kind* saying how the layouts differ:

- `copy`: same layout.
- `qkv`: HF q, k, v -> Megatron's fused `linear_qkv`, interleaved per query group
  ([q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]).
- `gate_up`: HF gate and up projections -> Megatron's fused `linear_fc1` = [gate; up].
- `vocab`: rows padded to a multiple of the TP size (padding rows are zero and never exported).
- `mla_q`, `mla_kv`: Megatron's MLA expects the rope dimensions of q and k interleaved in pairs
  (DeepSeek's own layout, HF `rope_interleave=true`) and de-interleaves them itself. A checkpoint
  with `rope_interleave=false` keeps them as halves, so its rope rows are interleaved on the way in
  ([h0, h4, h1, h5, ...] for 8 dims) and de-interleaved on the way out.

How a tensor is *sharded* is not declared here: Megatron marks every tensor-parallel parameter
with `partition_dim`, so the loader reads it from the parameter itself. Only `gate_up` needs to
know about TP: each rank holds [gate shard; up shard], not a contiguous slice of [gate; up].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["copy", "qkv", "gate_up", "vocab", "mla_q", "mla_kv"]
_PLACEHOLDER = re.compile(r"\{(layer|expert)\}")


@dataclass(frozen=True)
class WeightRule:
    megatron: str
    """Canonical Megatron name template, e.g. `decoder.layers.{layer}.mlp.linear_fc1.weight`."""
    hf: tuple[str, ...]
    """HF name templates, in the order the kind expects (q, k, v / gate, up)."""
    kind: Kind = "copy"
    export: bool = True
    """False for Megatron-only copies (the untied output layer of a tied-embedding model)."""

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.megatron

    def pattern(self) -> re.Pattern[str]:
        escaped = re.escape(self.megatron).replace(r"\{layer\}", r"(?P<layer>\d+)")
        return re.compile("^" + escaped.replace(r"\{expert\}", r"(?P<expert>\d+)") + "$")

    def hf_names(self, fields: dict[str, str]) -> list[str]:
        return [_PLACEHOLDER.sub(lambda m: fields[m.group(1)], t) for t in self.hf]


class RuleSet:
    """All rules of one architecture, matched by canonical Megatron name."""

    def __init__(self, rules: list[WeightRule]) -> None:
        self.rules = rules
        self._compiled = [(rule.pattern(), rule) for rule in rules]

    def match(self, megatron_name: str) -> tuple[WeightRule, list[str]] | None:
        for pattern, rule in self._compiled:
            found = pattern.match(megatron_name)
            if found:
                fields = {k: v for k, v in found.groupdict().items() if v is not None}
                return rule, rule.hf_names(fields)
        return None


# ---------------------------------------------------------------------------- layout transforms
