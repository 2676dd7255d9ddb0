"""The embedded engine in-process: continuous batching is exact, logprobs are the sampler's, control works.

References are computed with a separate transformers model and no KV cache at all (one full
forward per token), so they share no code with the engine's batching.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimrl.rollout.embedded.engine import (
    EmbeddedEngine,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
)
from slimrl.rollout.embedded.sampling import SamplingParams
from slimrl.rollout.embedded.weights import WeightUpdateError

EOS = 2


@pytest.fixture(scope="module")
def moe_path(tiny_model) -> Path:
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def engine(moe_path) -> Iterator[EmbeddedEngine]:
    with EmbeddedEngine(moe_path, max_running_requests=16) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(moe_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


def _logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _greedy(model, prompt: list[int], max_new: int, ignore_eos: bool) -> list[int]:
    out: list[int] = []
    for _ in range(max_new):
        out.append(int(_logits(model, prompt + out)[-1].argmax()))
        if out[-1] == EOS and not ignore_eos:
            break
    return out


def _prompts(engine: EmbeddedEngine, n: int) -> list[list[int]]:
    texts = ["2+3=", "hello world, ", "The quick brown fox", "x", "1234567890" * 3, "abc " * 7, "Q: ", "yo"]
    return [engine.tokenizer.encode(texts[i % len(texts)] + str(i)) for i in range(n)]


def _assert_reference_logprobs(model, prompt: list[int], result: GenerateResult) -> None:
    logits = _logits(model, prompt + result.generated_ids)
    dist = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    expected = dist.gather(1, torch.tensor(result.generated_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.output_token_logprobs), expected, atol=1e-5, rtol=0)


def _greedy_req(prompt: list[int], max_new: int, **kw) -> GenerateRequest:
    return GenerateRequest(
        input_ids=prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)
    )


def _wait_steps(engine: EmbeddedEngine, n: int, timeout: float = 30.0) -> None:
    target, deadline = engine.steps + n, time.monotonic() + timeout
    while engine.steps < target:
        assert time.monotonic() < deadline, "the scheduler made no progress"
        time.sleep(0.0005)


def test_continuous_batching_equals_sequential_greedy(engine, reference):
    prompts = _prompts(engine, 8)
    max_new = [12 + 3 * i for i in range(8)]
    ignore = [i % 2 == 0 for i in range(8)]
    start_steps = engine.steps
    futures: list[Future[GenerateResult]] = []
    for i, prompt in enumerate(prompts):  # requests join a running batch at different steps
        req = GenerateRequest(
            input_ids=prompt,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new[i], ignore_eos=ignore[i]),
            return_logprob=True,
        )
        futures.append(engine.submit(req))
        if i % 3 != 2:
            _wait_steps(engine, 2)
    results = [f.result(60) for f in futures]
    # One request at a time would need a step per token: the ignore_eos requests alone are 84 tokens,
    # while staggered arrival (~12 steps) plus the longest request (33) is ~50 batched steps.
    assert engine.steps - start_steps < sum(n for n, ign in zip(max_new, ignore, strict=True) if ign)
    for prompt, result, n, ign in zip(prompts, results, max_new, ignore, strict=True):
        assert result.generated_ids == _greedy(reference, prompt, n, ign)
        _assert_reference_logprobs(reference, prompt, result)


def test_requests_arriving_together_share_one_prefill(moe_path, reference):
    """Left-padded batched prefill: same tokens and logprobs as the reference, one forward for all."""
    with EmbeddedEngine(moe_path, max_running_requests=32, start=False) as eng:
        prompts = [p[: 3 + i % 7] for i, p in enumerate(_prompts(eng, 12))]
        max_new = [1 if i % 3 == 0 else 5 for i in range(12)]  # some finish at their first token
        futures = [
            eng.submit(
                GenerateRequest(
                    input_ids=prompt,
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
                    return_logprob=True,
                )
            )
            for prompt, n in zip(prompts, max_new, strict=True)
        ]
        eng.start()  # everything is waiting: the first step prefills all twelve together
        results = [f.result(60) for f in futures]
        assert eng.steps <= max(max_new)  # one prefill step, then the decodes
    for prompt, result, n in zip(prompts, results, max_new, strict=True):
        assert result.generated_ids == _greedy(reference, prompt, n, True)
        _assert_reference_logprobs(reference, prompt, result)


def test_sampled_logprobs_are_the_sampling_steps_own(moe_path, reference):
    seen: dict[str, list[tuple[torch.Tensor, int, float]]] = {}

    def observe(rid: str, dist: torch.Tensor, token: int, logprob: float) -> None:
        seen.setdefault(rid, []).append((dist.clone(), token, logprob))

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, sampling_seed=3)
    with EmbeddedEngine(moe_path, on_sample=observe) as eng:
        prompts = _prompts(eng, 4)
        futures = [
            eng.submit(GenerateRequest(input_ids=p, sampling=params, rid=f"s{i}", return_logprob=True))
            for i, p in enumerate(prompts)
        ]
        results = [f.result(60) for f in futures]
    for prompt, result in zip(prompts, results, strict=True):
        steps = seen[result.rid]
        assert [t for _, t, _ in steps] == result.generated_ids
        for (dist, token, logprob), reported in zip(steps, result.output_token_logprobs, strict=True):
            assert reported == logprob == float(dist[token])  # exactly what the sampler saw
            assert token in torch.topk(dist, 20).indices.tolist()
        logits = _logits(reference, prompt + result.generated_ids)[len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / 0.7, dim=-1).gather(
            1, torch.tensor(result.generated_ids)[:, None]
        )
        torch.testing.assert_close(
            torch.tensor(result.output_token_logprobs), expected[:, 0], atol=1e-5, rtol=0
        )


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    prompt = engine.tokenizer.encode("sample me: ")
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=1234)
    alone = engine.generate(GenerateRequest(input_ids=prompt, sampling=params), timeout=60)
    others = [
        engine.submit(
            GenerateRequest(
                input_ids=p, sampling=SamplingParams(temperature=1.0, max_new_tokens=5 + i, sampling_seed=i)
            )
        )
        for i, p in enumerate(_prompts(engine, 5))
    ]
    _wait_steps(engine, 2)
    crowded = engine.generate(GenerateRequest(input_ids=prompt, sampling=params), timeout=60)
    for f in others:
        f.result(60)
    assert crowded.generated_ids == alone.generated_ids
    other_seed = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, sampling_seed=99)
    assert (
        engine.generate(GenerateRequest(input_ids=prompt, sampling=other_seed)).generated_ids
        != alone.generated_ids
    )


def test_batched_draw_equals_the_per_request_draw():
    """Rows without truncation are drawn together (`_draw_untruncated`); each gets the token, the
    logprob and the generator state that `_draw` alone gives it, whatever shares the batch."""
    from slimrl.rollout.embedded.sampling import _draw, sample_step

    rng = torch.Generator().manual_seed(0)
    for rows, vocab, scale in [(1, 3, 1.0), (37, 104, 5.0), (64, 103, 30.0), (9, 4099, 0.1)]:
        logits = torch.randn(rows, vocab, generator=rng) * scale
        params = [
            SamplingParams(temperature=[1.0, 0.7, 1.3, 0.0][i % 4], top_k=5 if i % 5 == 4 else -1)
            for i in range(rows)
        ]
        seeds = torch.randint(0, 1 << 40, (rows,), generator=rng).tolist()
        batched = [torch.Generator().manual_seed(s) for s in seeds]
        alone = [torch.Generator().manual_seed(s) for s in seeds]
        step = sample_step(logits, params, batched, [()] * rows)
        for row, p in enumerate(params):
            dist = step.distributions[row]
            expected = int(torch.argmax(logits[row])) if p.greedy else _draw(dist, p, alone[row], ())
            assert step.tokens[row] == expected
            assert step.logprobs[row] == float(dist[expected])
            assert torch.equal(batched[row].get_state(), alone[row].get_state())


def test_stop_token_ids_and_trim(engine):
    prompt = engine.tokenizer.encode("stop test ")
    free = engine.generate(_greedy_req(prompt, 12, ignore_eos=True)).generated_ids
    stop = free[4]
    k = free.index(stop)
    trimmed = engine.generate(_greedy_req(prompt, 12, stop_token_ids=(stop,)))
    assert trimmed.finish_reason == {"type": "stop", "matched": stop}
    assert trimmed.generated_ids == free[: k + 1] and trimmed.output_ids == free[: k + 1]  # SGLang keeps it
    assert trimmed.text == engine.tokenizer.decode(free[:k])  # only the text drops the stop token
    assert len(trimmed.output_token_logprobs) == k + 1  # logprobs cover every sampled token (SGLang)
    kept = engine.generate(_greedy_req(prompt, 12, stop_token_ids=(stop,), no_stop_trim=True))
    assert kept.output_ids == free[: k + 1]
    ignored = engine.generate(_greedy_req(prompt, 12, stop_token_ids=(stop,), ignore_eos=True))
    assert ignored.finish_reason == {"type": "length", "length": 12}  # ignore_eos disables stop ids too


def test_stop_strings_match_decoded_text(engine):
    prompt = engine.tokenizer.encode("strings ")
    free = engine.generate(_greedy_req(prompt, 12, ignore_eos=True)).generated_ids
    text = engine.tokenizer.decode(free)
    stop = text[3:5]
    k = next(i for i in range(len(free)) if stop in engine.tokenizer.decode(free[: i + 1]))
    result = engine.generate(_greedy_req(prompt, 12, stop=(stop,), ignore_eos=True))
    assert result.finish_reason == {"type": "stop", "matched": stop}
    assert result.output_ids == free[: k + 1]  # a stop string trims text only (SGLang)
    full = engine.tokenizer.decode(free[: k + 1])
    assert result.text == full[: full.find(stop)]
    kept = engine.generate(_greedy_req(prompt, 12, stop=(stop,), ignore_eos=True, no_stop_trim=True))
    assert kept.text == full


def test_max_new_tokens_zero_scores_the_prompt(engine, reference):
    prompt = engine.tokenizer.encode("score this prompt")
    for start in (0, 5):
        req = GenerateRequest(
            input_ids=prompt,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=0),
            return_logprob=True,
            logprob_start_len=start,
        )
        result = engine.generate(req)
        assert result.generated_ids == [] and result.finish_reason == {"type": "length", "length": 0}
        assert result.input_token_ids == prompt[start:]
        assert (
            result.input_token_logprobs[0] is None and len(result.input_token_logprobs) == len(prompt) - start
        )
        dist = torch.log_softmax(_logits(reference, prompt), dim=-1)
        expected = [float(dist[j - 1, prompt[j]]) for j in range(start + 1, len(prompt))]
        torch.testing.assert_close(
            torch.tensor(result.input_token_logprobs[1:]), torch.tensor(expected), atol=1e-5, rtol=0
        )


def test_abort_keeps_partial_output(engine, reference):
    prompt = engine.tokenizer.encode("a long one ")
    future = engine.submit(
        GenerateRequest(
            input_ids=prompt,
            sampling=SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True),
            rid="abort-me-7",
        )
    )
    waiting = engine.pause("in_place")
    waiting.result(10)
    queued = engine.submit(_greedy_req(prompt, 5))  # waits: generation is paused
    assert engine.abort("nothing-matches").result(10) == 0
    engine.continue_generation().result(10)
    _wait_steps(engine, 10)
    assert engine.abort("abort-me").result(10) == 1  # rid prefix, as SGLang
    result = future.result(10)
    assert result.finish_reason["type"] == "abort"
    n = result.completion_tokens
    assert 0 < n < 300 and len(result.output_token_logprobs) == n
    assert result.generated_ids == _greedy(reference, prompt, n, True)
    assert queued.result(10).finish_reason["type"] == "length"


def test_pause_in_place_and_retract_resume_exactly(engine, reference):
    prompt = engine.tokenizer.encode("pause me ")
    expected = _greedy(reference, prompt, 40, True)
    for mode in ("in_place", "retract"):
        future = engine.submit(_greedy_req(prompt, 40, ignore_eos=True))
        _wait_steps(engine, 5)
        engine.pause(mode).result(10)
        frozen = engine.steps
        time.sleep(0.05)
        assert engine.steps == frozen and not future.done()
        assert engine.flush_cache().result(10) is (mode == "retract")  # in_place keeps the KV cache
        engine.continue_generation().result(10)
        result = future.result(30)
        assert result.generated_ids == expected
        assert result.num_retractions == (mode == "retract")
    future = engine.submit(_greedy_req(prompt, 300, ignore_eos=True))
    _wait_steps(engine, 3)
    engine.pause("abort").result(10)
    assert future.result(10).finish_reason["type"] == "abort"
    engine.continue_generation().result(10)
    assert engine.flush_cache().result(10) is True


def test_release_memory_refuses_generation(engine, moe_path):
    engine.release_memory(None).result(10)
    with pytest.raises(EngineUnavailable):
        engine.submit(_greedy_req([5, 6], 2))
    engine.resume_memory(["kv_cache", "cuda_graph"]).result(10)
    assert engine.generate(_greedy_req([5, 6], 2)).completion_tokens == 2
    engine.resume_memory(["weights"]).result(10)  # lost (NaN) while released: load them again
    engine.update_weights_from_disk(moe_path).result(30)


def test_routed_experts_are_the_routers_choices(engine, reference):
    prompt = engine.tokenizer.encode("route ")
    req = GenerateRequest(
        input_ids=prompt,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
        return_routed_experts=True,
    )
    result = engine.generate(req)
    layers, top_k = reference.config.num_hidden_layers, reference.config.num_experts_per_tok
    seq = prompt + result.generated_ids
    assert tuple(result.routed_experts.shape) == (len(seq) - 1, layers, top_k)
    assert result.routed_experts.dtype == torch.int32
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
        for layer in reference.model.layers
    ]
    try:
        _logits(reference, seq[:-1])
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(result.routed_experts, torch.stack(chosen, dim=1).to(torch.int32))
    req.routed_experts_start_len = 3
    assert engine.generate(req).routed_experts.shape[0] == len(seq) - 4


def test_rescorer_replaces_output_logprobs(moe_path):
    calls: list[tuple[list[int], int]] = []

    def rescore(tokens: list[int], response_length: int) -> list[float]:
        calls.append((tokens, response_length))
        return [-0.5] * response_length

    with EmbeddedEngine(moe_path, rescorer=rescore) as eng:
        result = eng.generate(
            GenerateRequest(
                input_ids=[10, 11, 12],
                sampling=SamplingParams(max_new_tokens=4, ignore_eos=True),
                return_logprob=True,
            )
        )
    assert result.output_token_logprobs == [-0.5] * 4
    assert calls == [([10, 11, 12, *result.generated_ids], 4)]


def test_weight_update_round_trip_through_fused_experts(moe_path):
    with EmbeddedEngine(moe_path) as eng:
        prompt = eng.tokenizer.encode("weights ")
        before = eng.generate(_greedy_req(prompt, 10, ignore_eos=True)).generated_ids
        original = {k: v.clone() for k, v in eng.model.state_dict().items()}

        def perturb() -> None:
            gen = torch.Generator().manual_seed(0)
            for p in eng.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)

        eng.call_async(perturb).result(10)
        assert eng.generate(_greedy_req(prompt, 10, ignore_eos=True)).generated_ids != before
        checkpoint = load_file(str(moe_path / "model.safetensors"))
        assert any(".experts.0.gate_proj." in name for name in checkpoint)  # per-expert HF names
        assert eng.update_weights(checkpoint.items(), weight_version="v1").result(10) == len(checkpoint)
        assert eng.weight_version == "v1"
        for name, tensor in eng.model.state_dict().items():
            assert torch.equal(tensor, original[name]), name
        assert eng.generate(_greedy_req(prompt, 10, ignore_eos=True)).generated_ids == before

        bad = dict(checkpoint)
        bad["model.layers.0.mlp.experts.1.up_proj.weight"] = torch.zeros(3, 3)
        with pytest.raises(WeightUpdateError, match=r"experts\.1\.up_proj\.weight"):
            eng.update_weights(bad.items()).result(10)
        with pytest.raises(WeightUpdateError, match=r"model\.layers\.9\.nope"):
            eng.update_weights([("model.layers.9.nope", torch.zeros(1))]).result(10)
        for name, tensor in eng.model.state_dict().items():  # failed updates change nothing
            assert torch.equal(tensor, original[name]), name
        assert eng.weight_version == "v1"


def test_tied_embeddings_stay_tied(tiny_model):
    from transformers import AutoModelForCausalLM

    base, other = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    with EmbeddedEngine(base) as eng:
        model = eng.model
        assert model.lm_head.weight is model.model.embed_tokens.weight
        eng.update_weights_from_disk(other, weight_version="2").result(10)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        prompt = eng.tokenizer.encode("tied ")
        got = eng.generate(_greedy_req(prompt, 8, ignore_eos=True)).generated_ids
        assert eng.weight_version == "2"
    fresh = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    assert got == _greedy(fresh, prompt, 8, True)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_tensor_payloads_round_trip_and_refuse_other_globals():
    """What the trainer sends (`weight_sync.wire`) decodes in the engine; nothing else does."""
    import base64
    import pickle

    from slimrl.rollout.embedded import tensor_transport as tt
    from slimrl.weight_sync import wire

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    named = [
        ("a", base[1:3]),
        ("b", torch.ones(3, dtype=torch.bfloat16)),
        ("p", torch.nn.Parameter(base.clone())),
    ]
    update = wire.tensor_update(named, "v")
    entries = update.body(2)["serialized_named_tensors"]
    assert len(entries) == 2  # one per TP rank
    cases = ((None, wire.serialize(named), named), ("flattened_bucket", entries[1], wire.aligned(named)))
    for load_format, payload, expected in cases:
        decoded = tt.decode_update_payload(payload, load_format)
        assert [n for n, _ in decoded] == [n for n, _ in expected]
        for (_, got), (_, want) in zip(decoded, expected, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want.detach())
    ordered = wire.aligned(named)  # widest dtype first, as the trainer sends a bucket
    dtypes, shapes = [t.dtype for _, t in ordered], [t.shape for _, t in ordered]
    flat = wire.pack_for_broadcast([t.detach() for _, t in ordered], torch.device("cpu"))
    split = tt.split_flat_buffer(flat, [n for n, _ in ordered], dtypes, shapes)
    assert all(torch.equal(got, want.detach()) for (_, got), (_, want) in zip(split, ordered, strict=True))
    with pytest.raises(ValueError, match="unaligned"):  # SGLang's receive layout refuses it too
        tt.flattened_layout([torch.bfloat16, torch.float32], [[1], [1]])

    class Evil:  # os.system pickles as posix.system wherever it runs (print does not: Ray's
        def __reduce__(self):  # log forwarding replaces builtins.print in a process that ran it)
            return (os.system, ("true",))

    evil = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    with pytest.raises(ValueError, match=r"blocked unsafe global posix\.system"):
        tt.decode_update_payload(evil, None)
    with pytest.raises(ValueError, match="base64"):
        tt.decode_update_payload("not base64!", None)
