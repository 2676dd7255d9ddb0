"""The trainer's process groups as Megatron-Core 0.16 forms them, without importing it.

`megatron.core.parallel_state` takes ~10-20 s to import (the whole package comes with it), which a
`--dry-run` on a laptop and every config load cannot pay. The arithmetic is small: ranks are laid
out in the order `tp-cp-ep-dp-pp` (Megatron's default `order`), and a group of some dimensions
holds the ranks that differ only along them. Two generators exist, as in
`initialize_model_parallel`: the decoder's (tp, cp, dp, pp) and the experts' (etp, ep, edp, pp).
`tests/test_ledger.py` checks every group against Megatron's own `RankGenerator`, and the trainer
ranks check the groups Megatron actually built against these at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

ORDER = ("tp", "cp", "ep", "dp", "pp")
"""Megatron-Core's default rank order (`initialize_model_parallel(order="tp-cp-ep-dp-pp")`)."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """The sizes the trainer's groups follow from (a `ParallelLayout`'s, or a config's resolved)."""

    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int

    @classmethod
    def of(cls, layout: object) -> Sizes:
        """From anything with the six sizes as attributes (a trainer `ParallelLayout`)."""
        return cls(**{k: getattr(layout, k) for k in ("tp", "pp", "cp", "ep", "etp", "dp")})

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data parallel: what is left of the world over etp * ep * pp."""
        return self.world // (self.etp * self.ep * self.pp)


def orthogonal_groups(sizes: dict[str, int], dims: tuple[str, ...]) -> list[list[int]]:
    """Groups of the ranks that differ only along `dims`, with ranks numbered in ORDER (the first
    dimension varies fastest). Groups come in Megatron's order: by the fixed dimensions' index,
    the first fixed dimension fastest; inside a group by the varying dimensions' index, likewise."""
    shape = [sizes.get(d, 1) for d in ORDER]
    stride = [1]
    for size in shape[:-1]:
        stride.append(stride[-1] * size)
    varying = [i for i, d in enumerate(ORDER) if d in dims]
    fixed = [i for i, d in enumerate(ORDER) if d not in dims]

    def ranks(indices: list[tuple[int, int]]) -> int:
        return sum(idx * stride[axis] for axis, idx in indices)

    def index_space(axes: list[int]) -> list[tuple[int, ...]]:
        # itertools.product varies the last axis fastest; Megatron varies the first fastest
        return [tuple(reversed(t)) for t in product(*(range(shape[a]) for a in reversed(axes)))]

    groups = []
    for outer in index_space(fixed):
        base = ranks(list(zip(fixed, outer, strict=True)))
        groups.append([base + ranks(list(zip(varying, i, strict=True))) for i in index_space(varying)])
    return groups


def decoder_groups(s: Sizes, dims: tuple[str, ...]) -> list[list[int]]:
    return orthogonal_groups({"tp": s.tp, "cp": s.cp, "dp": s.dp, "pp": s.pp}, dims)


def expert_groups(s: Sizes, dims: tuple[str, ...]) -> list[list[int]]:
    """Megatron's expert generator names etp "tp" and edp "dp"."""
    return orthogonal_groups({"tp": s.etp, "ep": s.ep, "dp": s.edp, "pp": s.pp}, dims)


def embedding_groups(s: Sizes) -> list[list[int]]:
    """First and last pipeline stage of each pipeline group (`default_embedding_ranks`)."""
    return [[ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]] for ranks in decoder_groups(s, ("pp",))]


TRAINER_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    # purpose: (generator, Megatron's token); the groups a rank uses in training and in the export
    "tensor_parallel": ("decoder", ("tp",)),
    "pipeline_parallel": ("decoder", ("pp",)),
    "context_parallel": ("decoder", ("cp",)),
    "data_parallel": ("decoder", ("cp", "dp")),
    "model_parallel": ("decoder", ("tp", "pp")),
    "expert_parallel": ("expert", ("ep",)),
    "expert_tensor_parallel": ("expert", ("tp",)),
    "expert_data_parallel": ("expert", ("dp",)),
    "expert_model_parallel": ("expert", ("tp", "ep")),
}


def trainer_groups(s: Sizes) -> dict[str, list[list[int]]]:
    """Every trainer group of more than one rank, by purpose (embedding groups included)."""
    out: dict[str, list[list[int]]] = {}
    for purpose, (generator, dims) in TRAINER_GROUPS.items():
        groups = (decoder_groups if generator == "decoder" else expert_groups)(s, dims)
        out[purpose] = [g for g in groups if len(g) > 1]
    out["embedding"] = [g for g in embedding_groups(s) if len(g) > 1]
    return {purpose: groups for purpose, groups in out.items() if groups}
