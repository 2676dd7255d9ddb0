"""SGLang 0.5.23's own weight loaders referee our weight export, for every architecture we ship.

Each bucket of a weight update reaches SGLang as one call of the model's `load_weights`, and some
loaders need tensors together in one call (DeepSeek's `q_a_proj` + `kv_a_proj_with_mqa` fusion).
`tests/dist/sglang_loader_worker.py` builds SGLang's model classes on CPU and compares, bit for bit,
a model loaded from the checkpoint with one fed our buckets at bucket sizes down to one byte (every
tensor its own bucket), under TP1 and 2-rank layouts (TP2, EP2). The unit tests pin `bucketed`.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from slimrl.megatron_bridge.archs import arch_from_hf_config
from slimrl.megatron_bridge.bucketing import Together, bucketed, load_together
from tests.conftest import REPO, run_torchrun

WORKER = REPO / "tests" / "dist" / "sglang_loader_worker.py"
DEEPSEEK = (("q_a_proj", "kv_a_proj_with_mqa"),)

# --- bucketed: unit tests ---------------------------------------------------------------------


def t(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


def mla_stream(layers: int = 2, scales: bool = False) -> list[tuple[str, torch.Tensor]]:
    """DeepSeek's export order: q_b_proj sits between the two tensors SGLang fuses."""
    out = [("model.embed_tokens.weight", t(40))]
    for layer in range(layers):
        p = f"model.layers.{layer}.self_attn."
        sizes = {"q_a_proj": 16, "q_b_proj": 24, "kv_a_proj_with_mqa": 10, "kv_b_proj": 32}
        for proj, nbytes in sizes.items():
            out.append((p + proj + ".weight", t(nbytes)))
            if scales:
                out.append((p + proj + ".weight_scale_inv", t(4)))
        out.append((f"model.layers.{layer}.mlp.down_proj.weight", t(8)))
    return [*out, ("lm_head.weight", t(40))]


def groups_of(names: list[str], together: Together) -> dict[str, set[str]]:
    """SGLang's pairing: names equal once the member component is replaced."""
    out: dict[str, set[str]] = {}
    for name in names:
        for members in together:
            for member in members:
                if f".{member}." in name:
                    out.setdefault(name.replace(f".{member}.", ".*."), set()).add(name)
    return out


def check_buckets(
    stream: list[tuple[str, torch.Tensor]], buckets: list[list[tuple[str, torch.Tensor]]], limit: int,
    together: Together,
) -> None:  # fmt: skip
    sizes = {n: x.numel() for n, x in stream}
    flat = [n for b in buckets for n, _ in b]
    assert sorted(flat) == sorted(sizes), "a tensor was lost or duplicated"
    groups = groups_of(flat, together)
    grouped = {n for g in groups.values() for n in g}
    where = {n: i for i, b in enumerate(buckets) for n, _ in b}
    for key, members in groups.items():
        assert len({where[n] for n in members}) == 1, f"group {key} split: {sorted(members)}"
    # Order: ungrouped tensors keep theirs; a group sits, members in stream order, where its last was.
    assert [n for n in flat if n not in grouped] == [n for n, _ in stream if n not in grouped]
    position = {n: i for i, (n, _) in enumerate(stream)}
    for members in groups.values():
        at = sorted(flat.index(n) for n in members)
        assert at == list(range(at[0], at[0] + len(members)))
        assert [flat[i] for i in at] == sorted(members, key=position.__getitem__)
        last = max(members, key=position.__getitem__)
        before = {n for n, _ in stream[: position[last]] if n not in grouped}
        assert {n for n in flat[: at[0]] if n not in grouped} == before
    for bucket in buckets:  # over the limit only as a single tensor or a single group
        size = sum(sizes[n] for n, _ in bucket)
        names = {n for n, _ in bucket}
        assert size <= limit or len(bucket) == 1 or any(names == g for g in groups.values()), bucket


@pytest.mark.parametrize("scales", [False, True], ids=["bf16", "fp8_scales"])
def test_groups_never_split_at_any_bucket_size(scales: bool) -> None:
    stream = mla_stream(scales=scales)
    total = sum(x.numel() for _, x in stream)
    for limit in range(1, total + 2):
        check_buckets(stream, list(bucketed(iter(stream), limit, together=DEEPSEEK)), limit, DEEPSEEK)


def test_group_is_placed_at_its_last_member() -> None:
    stream = mla_stream(layers=1)
    buckets = list(bucketed(iter(stream), 30, together=DEEPSEEK))
    assert [[n.removeprefix("model.layers.0.") for n, _ in b] for b in buckets] == [
        ["model.embed_tokens.weight"],
        ["self_attn.q_b_proj.weight"],
        ["self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"],  # 26 bytes
        ["self_attn.kv_b_proj.weight"],
        ["mlp.down_proj.weight"],
        ["lm_head.weight"],
    ]


def test_without_groups_the_stream_is_cut_by_size_only() -> None:
    stream = mla_stream()
    for limit in (1, 30, 64, 1 << 20):
        buckets = list(bucketed(iter(stream), limit))
        assert [n for b in buckets for n, _ in b] == [n for n, _ in stream]
        for bucket, following in itertools.pairwise(buckets):
            size = sum(x.numel() for _, x in bucket)
            assert size <= limit or len(bucket) == 1
            assert size + following[0][1].numel() > limit  # cut only when the next would not fit


def test_incomplete_group_goes_out_at_the_end() -> None:
    # A member this rank does not own never arrives: the rest is not lost, only held to the end.
    stream = [(n, x) for n, x in mla_stream(layers=1) if "kv_a_proj" not in n]
    buckets = list(bucketed(iter(stream), 1 << 20, together=DEEPSEEK))
    assert [n for b in buckets for n, _ in b][-1] == "model.layers.0.self_attn.q_a_proj.weight"
    assert sorted(n for b in buckets for n, _ in b) == sorted(n for n, _ in stream)


def test_each_architecture_declares_what_sglang_fuses() -> None:
    def arch(name: str, **overrides: Any) -> Any:
        cfg = json.loads((REPO / "configs" / "models" / name / "config.json").read_text())
        return arch_from_hf_config({**cfg, **overrides})

    assert load_together(arch("deepseek_v3")) == DEEPSEEK
    assert load_together(arch("moonlight_16b_a3b")) == ()  # no q_lora_rank: SGLang fuses nothing
    assert load_together(arch("qwen3_30b_a3b")) == ()
    assert load_together(arch("qwen3_235b_a22b")) == ()


# --- SGLang's loaders as referee --------------------------------------------------------------

BUCKET_BYTES = (1, 1024, 4096, 6144, 10240, 16384, 65536, 1 << 40)
"""1 byte: every tensor (and every group) its own bucket; the tiny tensors are 64 B to 26 KB; 1 TB:
one bucket."""

TP1, TP2, EP2 = ["parallel.tp=1"], ["parallel.tp=2"], ["parallel.ep=2"]
CASES: dict[str, tuple[str, dict[str, Any], dict[str, list[str]]]] = {
    "qwen3": ("qwen3", {}, {"tp1": TP1, "tp2": TP2}),
    "qwen3_moe": ("qwen3_moe", {}, {"tp1": TP1, "ep2": EP2}),
    # MLA with q_lora_rank (SGLang fuses q_a/kv_a), first layer dense, a shared expert.
    "deepseek_v3": ("deepseek_v3", {"q_lora_rank": 16}, {"tp1": TP1, "tp2": TP2, "ep2": EP2}),
    # Moonlight: DeepSeek-V3 without q_lora_rank (the tiny model's default).
    "moonlight": ("deepseek_v3", {}, {"tp1": TP1, "ep2": EP2}),
}


@pytest.fixture(scope="module")
def referee(tiny_model, tmp_path_factory) -> Callable[[], dict[str, Any]]:
    """Runs the worker once for all cases when a test first asks, so that a missing SGLang or a
    crash fails the tests (once, not once per case) rather than erroring their setup."""

    @functools.cache
    def run() -> dict[str, Any] | BaseException:
        out = tmp_path_factory.mktemp("sglang_loaders")
        spec = {
            "cases": {case: str(tiny_model(arch, **kw)) for case, (arch, kw, _) in CASES.items()},
            "layouts": {case: layouts for case, (_, _, layouts) in CASES.items()},
            "bucket_bytes": list(BUCKET_BYTES),
        }
        (out / "spec.json").write_text(json.dumps(spec))
        try:
            reports = run_torchrun(WORKER, 2, [str(out / "spec.json")], out, timeout=600)
        except AssertionError as exc:
            return exc
        return {case: report for rank in reports for case, report in rank.items()}

    def result() -> dict[str, Any]:
        got = run()
        if isinstance(got, BaseException):
            raise got
        return got

    return result


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize("case", list(CASES))
def test_sglang_loads_our_buckets_as_it_loads_the_checkpoint(referee, case: str) -> None:
    report = referee()[case]
    assert report["untouched"] == [], "the reference load left these at their start values"
    runs = [(layout, size, run) for layout, sizes in report["runs"].items() for size, run in sizes.items()]
    failures = [
        f"{layout}, bucket {size} B ({len(run['buckets'])} calls): {run['differ']}"
        for layout, size, run in runs if run["differ"]
    ]  # fmt: skip
    assert not failures, "SGLang's model differs from its checkpoint load in:\n" + "\n".join(failures)
    # What the verdict rests on: every checkpoint tensor was sent once, and each set SGLang fuses
    # (`fused_qkv_a_proj_with_mqa` is among the compared tensors) reached it in one call.
    together = DEEPSEEK if CASES[case][1].get("q_lora_rank") else ()
    assert ("fused_qkv_a_proj_with_mqa" in str(report["compared"])) == bool(together)
    for layout, size, run in runs:
        sent = [n for bucket in run["buckets"] for n in bucket]
        assert sorted(sent) == report["checkpoint"], f"{layout}, {size} B: not every tensor once"
        for key, members in groups_of(sent, together).items():
            calls = {i for i, bucket in enumerate(run["buckets"]) if members & set(bucket)}
            assert len(calls) == 1, f"{layout}, {size} B: {key} split over load_weights calls"
