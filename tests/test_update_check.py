"""The rules of the update check (`weight_sync/verify.py`) on SGLang's own outputs: its weight
checker's compare message and checksum payloads are made here by SGLang 0.5.23's code; and the
fault point that corrupts an update in flight."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.embedded.weight_checker import WeightChecker
from slimrl.utils import faults
from slimrl.weight_sync.verify import compare_failure, disagreements, grouped, rank_checksums, unchanged


def sglang_compare_message(expect: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> str:
    from sglang.srt.utils import weight_checker as sglang_checker
    from sglang.srt.utils import weight_checker_comparator as comparator

    from slimrl.compat.sglang_cpu.weight_checker import patch

    patch(comparator)  # its chunks stay on the CPU
    entries = lambda d: sglang_checker._build_check_entries(d, set())  # noqa: E731
    with pytest.raises(Exception) as failed:
        sglang_checker._check_tensors(entries(expect), entries(actual))
    return str(failed.value)


def test_compare_failure_names_sglang_s_first_tensor_and_its_error() -> None:
    expect = {"a.weight": torch.zeros(4), "b.weight": torch.ones(3), "c.weight": torch.ones(2)}
    actual = {
        "a.weight": torch.zeros(4),
        "b.weight": torch.tensor([1.0, 3.5, 1.0]),
        "c.weight": torch.zeros(2),
    }
    message = sglang_compare_message(expect, actual)
    assert compare_failure(message) == (
        f"b.weight differs from the snapshot (max abs error 2.5, mean {2.5 / 3}) and 1 more tensor(s)"
    )
    assert compare_failure("") == "compare failed without a message"


def test_the_embedded_checker_fails_compare_as_sglang_words_it() -> None:
    model = torch.nn.Linear(3, 2)
    checker = WeightChecker(model)
    checker.handle("snapshot")
    with torch.no_grad():
        model.bias.add_(1.0)
    with pytest.raises(ValueError) as failed:
        checker.handle("compare")
    assert (
        compare_failure(str(failed.value)) == "bias differs from the snapshot (max abs error 1.0, mean 1.0)"
    )


def checksum_reply(tp_checksums: list[dict[str, str]]) -> dict:
    """A `/weights_checker` checksum reply in SGLang's shape (its tokenizer lists one entry per rank;
    `parallelism_info` is the list of roles of that rank)."""
    ranks = [
        {"checksums": c, "per_gpu_checksum": "x", "parallelism_info": [{"role": "target", "tp_rank": r}]}
        for r, c in enumerate(tp_checksums)
    ]
    return {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": "y"}


def test_engines_of_one_shard_layout_must_agree_tensor_by_tensor() -> None:
    a = rank_checksums(checksum_reply([{"w1": "01", "w2": "02"}, {"w1": "11", "w2": "12"}]))
    b = rank_checksums(checksum_reply([{"w1": "01", "w2": "02"}, {"w1": "11", "w2": "99"}]))
    assert a == {0: {"w1": "01", "w2": "02"}, 1: {"w1": "11", "w2": "12"}}
    assert disagreements({"http://e0": a, "http://e1": a}) == []
    assert disagreements({"http://e0": a, "http://e1": b}) == [
        "engine http://e1 TP rank 1: w2 has checksum 99, engine http://e0 has 12 (1 tensor(s) differ)"
    ]
    one_rank = rank_checksums(checksum_reply([{"w1": "zz"}]))  # another TP size: other shards
    assert disagreements({"http://e0": a, "http://e2": one_rank}) == []
    assert unchanged(a, b) == ["rank0/w1", "rank0/w2", "rank1/w1"]


def test_problems_of_several_engines_read_as_one_line() -> None:
    line = grouped([("http://e0", "stale"), ("http://e1", "stale"), ("http://e2", "off")])
    assert line == "engines http://e0, http://e1: stale; engine http://e2: off"


def test_the_fault_point_flips_a_new_place_at_each_push_only_where_and_when_asked(monkeypatch) -> None:
    unit = [("model.layers.0.mlp.gate.weight", torch.zeros(4, 64)), ("model.norm.weight", torch.ones(64))]
    monkeypatch.setattr(faults, "_pushes", {})
    monkeypatch.delenv(faults.CORRUPT_UPDATE, raising=False)
    assert all(a is b for (_, a), (_, b) in zip(faults.corrupt_update(unit, "1"), unit, strict=True))
    monkeypatch.setenv(faults.CORRUPT_UPDATE, "mlp.gate@1x2,norm@7")
    assert faults.corrupt_update(unit, "2")[0][1] is unit[0][1]  # another version: untouched
    pushes = [dict(faults.corrupt_update(unit, "1")) for _ in range(3)]
    flipped = [torch.nonzero(p["model.layers.0.mlp.gate.weight"].reshape(-1)).reshape(-1) for p in pushes]
    assert flipped[0].tolist() == list(range(64)) and flipped[1].tolist() == list(range(64, 128))
    assert flipped[2].numel() == 0  # x2: the third push goes through
    assert all(p["model.norm.weight"] is unit[1][1] for p in pushes)
    assert torch.equal(unit[0][1], torch.zeros(4, 64))  # the trainer's tensor is never touched
