"""Memory release as a GPU does it, in process: SGLang's memory saver stand-in for CPU servers
(`slimrl/compat/sglang_cpu/memory_saver.py`) and the embedded engine's release/resume.

Both engines over HTTP, real SGLang as the referee (lost weights, pushed weights, the backup, a
resume of what is held killing the server): tests/test_engine_contract.py, "memory release".
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from slimrl.compat.sglang_cpu.memory_saver import CpuMemorySaver
from slimrl.rollout.embedded.engine import EmbeddedEngine, EngineFatal, EngineUnavailable, GenerateRequest
from slimrl.rollout.embedded.sampling import SamplingParams

# ---------------------------------------------------------------------- the stand-in


def test_paused_storages_lose_their_contents_views_and_later_copies_included() -> None:
    saver = CpuMemorySaver()
    outside = torch.ones(3)
    with saver.region("weights"):
        linear = torch.nn.Linear(4, 3)  # Parameters wrap the storages torch.empty allocated
        index = torch.zeros(5, dtype=torch.int32)
        flags = torch.zeros(2, dtype=torch.bool)
        literal = torch.tensor([1.0, 2.0])  # built outside the dispatcher, then lift_fresh
        alias = outside.view(3)  # no new memory: not the region's
        with saver.disable():
            scratch = torch.ones(2)
    with saver.region("kv_cache"):
        kv = torch.full((4,), 7.0)
    transposed = linear.weight.t()
    linear.weight.data.copy_(torch.arange(12.0).view(3, 4))  # loaded later, into the same storage
    saver.pause("weights")
    assert torch.isnan(linear.weight).all() and torch.isnan(linear.bias).all()
    assert torch.isnan(transposed).all() and torch.isnan(literal).all()
    assert (index == torch.iinfo(torch.int32).max).all() and flags.all()
    assert torch.equal(outside, torch.ones(3)) and torch.equal(alias, torch.ones(3))
    assert torch.equal(scratch, torch.ones(2)) and torch.equal(kv, torch.full((4,), 7.0))
    saver.resume("weights")  # no backup: the garbage stays
    assert torch.isnan(linear.weight).all()
    saver.pause(None)  # every tag
    assert torch.isnan(kv).all()


def test_a_backed_up_region_comes_back_exactly_and_the_innermost_region_decides() -> None:
    saver = CpuMemorySaver()
    with saver.region("kv_cache"):
        with saver.region("weights", enable_cpu_backup=True):
            weight = torch.randn(6, 5)
        cache = torch.randn(3)
    expected = weight.clone()
    saver.pause("weights")
    saver.pause("weights")  # twice: the backup keeps the first (good) bytes
    assert torch.isnan(weight).all()
    saver.resume("weights")
    assert torch.equal(weight, expected)
    assert torch.isfinite(cache).all()  # untouched: only the kv_cache tag owns it
    saver.pause("kv_cache")
    assert torch.isnan(cache).all() and torch.equal(weight, expected)


def test_a_region_sees_only_its_own_threads_allocations() -> None:
    saver = CpuMemorySaver()
    other: list[torch.Tensor] = []
    with saver.region("weights"):
        thread = threading.Thread(target=lambda: other.append(torch.ones(2)))
        thread.start()
        thread.join()
        mine = torch.ones(2)
    saver.pause("weights")
    assert torch.isnan(mine).all() and torch.equal(other[0], torch.ones(2))


# ---------------------------------------------------------------------- the embedded engine


class Refreshing:
    """A rescorer that keeps a copy of the weights, refreshed from the engine's (as MegatronScorer)."""

    def __init__(self) -> None:
        self.copy: dict[str, torch.Tensor] = {}

    def refresh(self, targets) -> None:
        self.copy = {name: targets.get(name).detach().clone() for name in targets.names()}

    def __call__(self, tokens: list[int], response_length: int) -> list[float]:
        return [float(self.copy["lm_head.weight"].sum())] * response_length


@pytest.fixture(scope="module")
def moe_path(tiny_model) -> Path:
    return tiny_model("qwen3_moe")


def _answer(engine: EmbeddedEngine) -> tuple[list[int], list[float]]:
    request = GenerateRequest(
        input_ids=[5, 6, 7], sampling=SamplingParams(temperature=0.0, max_new_tokens=3), return_logprob=True
    )
    result = engine.generate(request, timeout=60)
    return result.generated_ids, result.output_token_logprobs


def test_released_weights_are_nan_until_loaded_and_the_rescorer_copy_is_lost_too(moe_path) -> None:
    rescorer = Refreshing()
    with EmbeddedEngine(moe_path, rescorer=rescorer) as engine:
        rescorer.refresh(engine.targets)
        good = _answer(engine)
        buffers = {name: b.clone() for name, b in engine.model.named_buffers()}
        engine.release_memory(["weights", "kv_cache"]).result(30)
        assert all(torch.isnan(p).all() for p in engine.model.parameters())
        assert all(torch.isnan(t).all() for t in rescorer.copy.values())  # no good copy left
        for name, buffer in engine.model.named_buffers():  # SGLang stashes and restores buffers
            assert torch.equal(buffer, buffers[name])
        engine.resume_memory(["weights", "kv_cache"]).result(30)
        assert all(math.isnan(v) for v in engine.get_weights_by_name("model.norm.weight", 4).result(30))
        tokens, logprobs = _answer(engine)
        assert tokens == [0, 0, 0] and all(math.isnan(lp) for lp in logprobs)  # NaN logits: argmax 0
        engine.update_weights_from_disk(moe_path).result(60)
        assert _answer(engine) == good


def test_the_weights_backup_restores_them_exactly(moe_path) -> None:
    rescorer = Refreshing()
    with EmbeddedEngine(moe_path, rescorer=rescorer, weights_cpu_backup=True) as engine:
        rescorer.refresh(engine.targets)
        before = [p.clone() for p in engine.model.parameters()]
        good = _answer(engine)
        engine.release_memory(None).result(30)
        assert all(torch.isnan(p).all() for p in engine.model.parameters())
        engine.resume_memory(None).result(30)
        assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), before, strict=True))
        assert all(torch.isfinite(t).all() for t in rescorer.copy.values())
        assert _answer(engine) == good


def test_resuming_a_tag_that_is_not_released_stops_the_scheduler(moe_path) -> None:
    with EmbeddedEngine(moe_path) as engine:
        told: list[EngineFatal] = []
        engine.on_fatal = told.append
        engine.release_memory(["kv_cache"]).result(30)
        with pytest.raises(EngineFatal, match="KeyError: 'weights'"):
            engine.resume_memory(["kv_cache", "weights"]).result(30)
        engine._thread.join(30)
        assert not engine.alive and told == [engine.fatal] and engine.fatal is not None
        with pytest.raises(EngineUnavailable):
            engine.flush_cache().result(5)
