"""One HTTP contract, two engines: real SGLang 0.5.23 (the referee) and the embedded engine.

Every test runs against both, on the tiny Qwen3-MoE in float32; what real SGLang does is the
contract, and the embedded engine was changed wherever it differed. One server per engine kind
serves the whole module (a real SGLang start takes 20-45 s and ~4 GB); it runs colocated, so real
SGLang has `--enable-memory-saver` (on CPU: slimrl/compat/sglang_cpu/memory_saver.py) and a memory
release loses the weights as on a GPU. Only the last tests start servers of their own.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from transformers import AutoTokenizer

from examples.multi_turn_tool_generate import generate as multi_turn_generate
from slimrl.errors import SlimError
from slimrl.rollout.client import POOL_KEEP_ALIVE_S, FleetClient
from slimrl.rollout.generate import RolloutContext, generate, sampling_params_for, turn_weight_versions
from slimrl.rollout.sample_checks import GENERATE_KEY, check_sample, model_vocab_size
from slimrl.sample import Sample, Status
from slimrl.weight_sync.engines import auth_header
from tests.engines import ENGINES, engine_config, hf_routing, running_engines, start_engine

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7]
GREEDY = {"temperature": 0.0}
LONG = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 500}
"""Long enough to act on while it runs (prompt + 500 fits the tiny model's 512 positions)."""
FLUSHED_PREFIX = "Cache flushed."
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
OUTSIDE_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
NOT_FLUSHED = "Weights were updated, but the cache was not flushed"

SERVER_KEEP_ALIVE_S = 5
"""SGLang's `SGLANG_TIMEOUT_KEEP_ALIVE` default: uvicorn closes a connection idle this long."""
ADMIN_KEY = "contract-admin-key"
"""Both engines run as `slimrl train` starts them: control endpoints behind a per-run admin key."""
REPLAY = "algorithm.routing_replay=true"
"""...and with MoE routing replay on (SGLang gets `--enable-return-routed-experts`)."""


def admin(path: str) -> dict[str, str]:
    return auth_header(path, None, ADMIN_KEY)


_greedy_by_engine: dict[str, dict[str, Any]] = {}
"""First test's greedy answer per engine, compared across engines once both ran."""


class Engine:
    """A running server of one kind, with the checkpoints it can load."""

    def __init__(self, kind: str, url: str, model: Path, other: Path) -> None:
        self.kind, self.url, self.model, self.other = kind, url, model, other

    def post(self, path: str, body: Any = None, timeout: float = 120) -> requests.Response:
        body = {} if body is None else body
        return requests.post(f"{self.url}/{path}", json=body, headers=admin(path), timeout=timeout)

    def get(self, path: str) -> requests.Response:
        return requests.get(f"{self.url}/{path}", headers=admin(path), timeout=60)

    def generate(self, ids: list[int], params: dict[str, Any], **extra: Any) -> Any:
        response = self.post("generate", {"input_ids": ids, "sampling_params": params, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    def running(self) -> int:
        return sum(load["num_running_reqs"] for load in self.get("v1/loads").json()["loads"])

    def wait_running(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.running() < count:
            assert time.monotonic() < deadline, f"{self.kind}: {count} request(s) never started"
            time.sleep(0.01)


class Background:
    """A `/generate` call on a thread, so the test can act while it runs."""

    def __init__(self, engine: Engine, params: dict[str, Any], **extra: Any) -> None:
        self.result: Any = None
        self._thread = threading.Thread(target=self._run, args=(engine, params, extra), daemon=True)
        self._thread.start()

    def _run(self, engine: Engine, params: dict[str, Any], extra: dict[str, Any]) -> None:
        self.result = engine.generate(PROMPT, params, **extra)

    def join(self, timeout: float = 60) -> Any:
        self._thread.join(timeout)
        assert self.result is not None, "the request did not return"
        return self.result


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tiny_model, tmp_path_factory) -> Iterator[Engine]:
    kind = request.param
    model, other = tiny_model("qwen3_moe"), tiny_model("qwen3_moe", seed=1)
    log_dir = tmp_path_factory.mktemp(f"contract-{kind}")
    overrides = (f"rollout.admin_api_key={ADMIN_KEY}", REPLAY)
    with running_engines(kind, model, log_dir, 1, *overrides) as (url,):
        yield Engine(kind, url, model, other)


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


# ---------------------------------------------------------------------- /generate


def test_generate_single_with_output_and_input_logprobs(engine: Engine) -> None:
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 6}, return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6 and len(out["output_ids"]) == 6
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
    assert all(t[0] < 0 for t in triples)
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == PROMPT and inputs[0][0] is None and all(t[0] < 0 for t in inputs[1:])
    _greedy_by_engine[engine.kind] = out
    if len(_greedy_by_engine) == len(ENGINES):  # greedy float32: same tokens, same logprobs
        ref, emb = (_greedy_by_engine[k] for k in ENGINES)
        assert ref["output_ids"] == emb["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            a, b = ref["meta_info"][key], emb["meta_info"][key]
            assert [x[1] for x in a] == [x[1] for x in b]
            assert max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True) if x[0] is not None) < 1e-5


def test_top_logprobs(engine: Engine) -> None:
    """`top_logprobs_num` k: per output token the k most likely tokens, most likely first, from the
    distribution its logprob was read from (greedy: the sampled token first, with its logprob)."""
    k = 3
    greedy = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 4}, return_logprob=True, top_logprobs_num=k)
    seeded = {"temperature": 0.7, "max_new_tokens": 4, "sampling_seed": 3}
    sampled = engine.generate(PROMPT, seeded, return_logprob=True, top_logprobs_num=k)
    for out in (greedy, sampled):
        meta = out["meta_info"]
        assert meta["input_top_logprobs"] == [] and len(meta["output_top_logprobs"]) == 4
        for row, (logprob, token, _) in zip(
            meta["output_top_logprobs"], meta["output_token_logprobs"], strict=True
        ):
            assert len(row) == k and all(len(t) == 3 and t[2] is None for t in row)
            assert [t[0] for t in row] == sorted((t[0] for t in row), reverse=True)
            assert logprob <= row[0][0] + 1e-6
            same = [t[0] for t in row if t[1] == token]
            assert all(abs(v - logprob) < 1e-5 for v in same)
    assert [row[0][1] for row in greedy["meta_info"]["output_top_logprobs"]] == greedy["output_ids"]


def test_generate_batch_equals_single_requests(engine: Engine) -> None:
    prompts = [PROMPT, [8, 9], [10, 11, 12, 13]]
    batch = engine.generate(prompts, {**GREEDY, "max_new_tokens": 4}, return_logprob=True)  # type: ignore[arg-type]
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, item in zip(prompts, batch, strict=True):
        single = engine.generate(prompt, {**GREEDY, "max_new_tokens": 4})
        assert item["output_ids"] == single["output_ids"] and len(item["output_ids"]) == 4
        assert item["meta_info"]["prompt_tokens"] == len(prompt)
        assert len(item["meta_info"]["output_token_logprobs"]) == 4


def test_stop_reasons(engine: Engine) -> None:
    free = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 8})["output_ids"]
    stop_token = free[2]
    first = free.index(stop_token)
    for trim in (False, True):
        out = engine.generate(
            PROMPT, {**GREEDY, "max_new_tokens": 8, "stop_token_ids": [stop_token], "no_stop_trim": trim}
        )
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
        assert out["output_ids"] == free[: first + 1]  # the stop token stays in output_ids either way
    text = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 8, "no_stop_trim": True})["text"]
    stop = text[2:4]
    out = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 8, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]  # trimmed without no_stop_trim
    zero = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    too_long = engine.post("generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 510}})
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]


# ---------------------------------------------------------------------- routed experts (routing replay)


def _wire(meta: dict[str, Any], layers: int = 2, top_k: int = 2) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, layers, top_k)


def test_routed_experts_are_the_hf_routers_top_k(engine: Engine) -> None:
    """Every prompt and completion token but the last: (prompt + completion - 1, layers, top_k)
    int32, the ids HF's router picks, in its order; `routed_experts_start_len` drops leading rows."""
    model_path = engine.get("get_model_info").json()["model_path"]
    sampled = {"temperature": 1.0, "max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 11}
    for prompt, params in ((PROMPT, {**GREEDY, "max_new_tokens": 7}), ([9, 40, 41, 42, 3], sampled)):
        out = engine.generate(prompt, params, return_routed_experts=True)
        seq = prompt + out["output_ids"]
        routed = _wire(out["meta_info"])
        assert routed.shape == (len(seq) - 1, 2, 2)
        np.testing.assert_array_equal(routed, hf_routing(model_path, seq))
        if params is sampled:
            continue
        later = engine.generate(prompt, params, return_routed_experts=True, routed_experts_start_len=2)
        assert later["output_ids"] == out["output_ids"]
        np.testing.assert_array_equal(_wire(later["meta_info"]), routed[2:])


def test_multi_turn_and_continued_samples_hold_every_tokens_routing(engine: Engine) -> None:
    """A multi-turn tool hook (tool tokens fed by the next call) and a continued partial sample end
    with one row per token but the last, equal to one HF forward over the stitched sequence."""
    model_path = engine.get("get_model_info").json()["model_path"]
    config = engine_config(engine.kind, engine.model, REPLAY)
    client = FleetClient([engine.url], admin_api_key=ADMIN_KEY)
    ctx = RolloutContext(config, AutoTokenizer.from_pretrained(engine.model), client)
    params = {**sampling_params_for(config), **GREEDY, "ignore_eos": True}

    async def scenario() -> tuple[Sample, Sample]:
        talk = Sample(index=3, group_index=1, prompt="12+30=")
        talk = await multi_turn_generate(ctx, talk, {**params, "max_new_tokens": 60})
        partial = Sample(index=4, group_index=2, prompt="7+8=")
        partial = await generate(ctx, partial, {**params, "max_new_tokens": 5})
        assert partial.status is Status.TRUNCATED and partial.rollout_routed_experts is not None
        assert partial.rollout_routed_experts.shape[0] == len(partial.tokens) - 1
        partial.status = Status.PENDING  # buffered by an aborted rollout, continued by the next
        partial = await generate(ctx, partial, {**params, "max_new_tokens": 12})
        await client.close()
        return talk, partial

    talk, partial = run(scenario)
    assert talk.metadata["tool_turns"] == 2 and 0 in talk.effective_loss_mask()  # tool tokens fed
    assert partial.response_length == 12
    for one in (talk, partial):
        check_sample(one, GENERATE_KEY, model_vocab_size(str(engine.model)), routing=ctx.routing)
        assert one.rollout_routed_experts is not None and one.rollout_routed_experts.dtype == np.uint8
        np.testing.assert_array_equal(one.rollout_routed_experts, hf_routing(model_path, one.tokens))


def test_weight_versions_spans_an_update_mid_request(engine: Engine) -> None:
    before = engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 3})["meta_info"]
    version = before["weight_version"]
    assert before["weight_versions"] == [{"version": version, "start": 0, "end": 3}]
    job = Background(engine, LONG)
    engine.wait_running(1)
    assert engine.post("pause_generation", {"mode": "in_place"}).json() == PAUSED
    new = f"{engine.kind}-mid"
    reply = engine.post("update_weight_version", {"new_version": new, "abort_all_requests": False})
    assert reply.status_code == 200
    assert reply.json() == {
        "success": True,
        "message": f"Weight version updated to {new}",
        "new_version": new,
    }
    assert engine.post("continue_generation").json() == CONTINUED
    meta = job.join()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == new
    old_span, new_span = meta["weight_versions"]
    assert old_span["version"] == version and new_span == {
        "version": new,
        "start": old_span["end"],
        "end": 500,
    }
    assert old_span["start"] == 0 and 0 < old_span["end"] < 500
    assert turn_weight_versions(meta) == [version, new]  # the sample records both, oldest first
    assert engine.get("get_model_info").json()["weight_version"] == new


# ---------------------------------------------------------------------- pause / continue / flush


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests_and_continue_finishes_them(engine: Engine, mode: str) -> None:
    flushed = engine.get("flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith(FLUSHED_PREFIX)
    job = Background(engine, LONG)
    engine.wait_running(1)
    busy = engine.get("flush_cache")
    assert busy.status_code == 400 and busy.text == "Flush cache failed.\n"  # plain text, as SGLang
    reply = engine.post("pause_generation", {"mode": mode})
    assert reply.status_code == 200 and reply.json() == PAUSED
    flush = engine.post("flush_cache")  # in_place keeps the KV cache of the running batch
    assert flush.status_code == (200 if mode == "retract" else 400)
    assert engine.post("continue_generation").json() == CONTINUED
    meta = job.join()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 500}
    assert meta["num_retractions"] == (1 if mode == "retract" else 0)


def test_pause_abort_returns_partial_output(engine: Engine) -> None:
    job = Background(engine, LONG, return_logprob=True)
    engine.wait_running(1)
    assert engine.post("pause_generation", {"mode": "abort"}).json() == PAUSED
    out = job.join()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"] == "Aborted"
    assert 0 < len(out["output_ids"]) < 500 and len(meta["output_token_logprobs"]) == len(out["output_ids"])
    assert engine.get("flush_cache").status_code == 200
    assert engine.post("continue_generation").json() == CONTINUED
    bad = engine.post("pause_generation", {"mode": "bogus"})
    assert bad.status_code == 400 and bad.json()["object"] == "error" and "in_place" in bad.json()["message"]


# ---------------------------------------------------------------------- abort


def test_abort_needs_the_exact_rid_or_abort_all(engine: Engine) -> None:
    rids = [f"{engine.kind}-abort-{i}" for i in range(2)]
    jobs = [Background(engine, LONG, rid=rid, return_logprob=True) for rid in rids]
    engine.wait_running(2)
    assert engine.post("pause_generation", {"mode": "in_place"}).status_code == 200
    for body in ({"rid": f"{engine.kind}-abort-"}, {"rid": rids[0]}):  # a prefix is ignored
        reply = engine.post("abort_request", body)
        assert reply.status_code == 200 and reply.content == b""
    assert engine.post("continue_generation").status_code == 200
    first = jobs[0].join()
    assert first["meta_info"]["finish_reason"]["type"] == "abort" and first["meta_info"]["id"] == rids[0]
    assert 0 < len(first["output_ids"]) < 500
    assert jobs[1].result is None  # the prefix did not reach the other one: still running
    reply = engine.post("abort_request", {"abort_all": True})
    assert reply.status_code == 200 and reply.content == b""
    second = jobs[1].join()["meta_info"]
    assert second["finish_reason"]["type"] == "abort" and second["completion_tokens"] < 500
    bad = engine.post("abort_request", {"rid": 5})
    assert bad.status_code == 400 and bad.json()["object"] == "error"


def test_client_aborts_a_prefix_by_its_exact_rids(engine: Engine) -> None:
    client = FleetClient([engine.url], admin_api_key=ADMIN_KEY)

    async def scenario() -> list[dict[str, Any]]:
        tasks = [
            asyncio.create_task(client.generate(input_ids=PROMPT, sampling_params=LONG, rid=f"cli-{i}"))
            for i in range(2)
        ]
        await asyncio.to_thread(engine.wait_running, 2)
        assert sorted(client.rids) == ["cli-0", "cli-1"]
        await client.abort("cli-")
        results = await asyncio.gather(*tasks)
        await client.close()
        return results

    for out in run(scenario):
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 500
    assert client.rids == {}


def test_idle_connections_close_after_five_seconds_and_the_client_pool_lets_them_go_sooner(
    engine: Engine,
) -> None:
    """SGLang's HTTP server (uvicorn) closes a keep-alive connection idle for
    `SGLANG_TIMEOUT_KEEP_ALIVE` s (5); the embedded engine does the same (aiohttp's default is an
    hour, which hid the race below). The client's pool reuses a connection only while it is idle
    for less (`POOL_KEEP_ALIVE_S`): with aiohttp's default of 15 s, a request after a longer pause (a
    weight sync on a loaded CI machine) went out on a connection the engine was closing, failed
    with "Can not write request body", and a one-engine run stopped with "every engine is down"."""
    host, port = engine.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/health", headers=admin("health"))
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("connection", "keep-alive") != "close"
    response.read()
    sock = conn.sock
    idle_since = time.monotonic()
    assert sock.recv(1) == b""  # blocks until the server closes its end
    idle_s = time.monotonic() - idle_since
    conn.close()
    assert SERVER_KEEP_ALIVE_S - 0.5 <= idle_s <= SERVER_KEEP_ALIVE_S + 2.5, idle_s
    assert idle_s - POOL_KEEP_ALIVE_S >= 2  # reuse ends well before the close can race it


# ---------------------------------------------------------------------- information


def test_model_info_and_weight_version_endpoints(engine: Engine) -> None:
    info = engine.get("get_model_info").json()
    assert info["model_path"] == str(engine.model) and info["tokenizer_path"] == str(engine.model)
    assert info["is_generation"] is True and info["model_type"] == "qwen3_moe"
    assert info["architectures"] == ["Qwen3MoeForCausalLM"]
    assert engine.get("get_weight_version").status_code == 404  # gone in 0.5.23: get_model_info has it
    reply = engine.post("update_weight_version", {"new_version": "v-info"})
    assert reply.json() == {
        "success": True,
        "message": "Weight version updated to v-info",
        "new_version": "v-info",
    }
    assert engine.get("model_info").json()["weight_version"] == "v-info"
    assert engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 1})["meta_info"]["weight_version"] == "v-info"


# ---------------------------------------------------------------------- weight-update sessions


def test_tensor_and_distributed_updates_need_a_session(engine: Engine) -> None:
    # Refused before the payload is read (a bad payload inside a session kills real SGLang).
    payload = base64.b64encode(b"not read outside a session").decode()
    tensor = engine.post("update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert tensor.status_code == 400
    assert tensor.json() == {
        "success": False,
        "message": OUTSIDE_SESSION.format("update_weights_from_tensor"),
    }
    body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]}
    dist = engine.post("update_weights_from_distributed", body)
    assert dist.status_code == 400
    assert dist.json() == {
        "success": False,
        "message": OUTSIDE_SESSION.format("update_weights_from_distributed"),
    }


def test_session_begin_end_rules(engine: Engine) -> None:
    end = engine.post("end_weight_update")
    assert (
        end.status_code == 400
        and end.json()["success"] is False
        and "no weight-update session" in end.json()["message"]
    )
    assert engine.post("begin_weight_update").json() == {"success": True, "message": "Success"}
    again = engine.post("begin_weight_update", {"selector": "all"})
    assert again.status_code == 400 and "already open" in again.json()["message"]
    assert engine.post("end_weight_update").json() == {"success": True, "message": "Success"}
    assert engine.post("end_weight_update").status_code == 400


def test_update_weights_from_disk_in_a_session(engine: Engine) -> None:
    params = {**GREEDY, "max_new_tokens": 8}
    original = engine.generate(PROMPT, params, return_logprob=True)
    assert engine.post("begin_weight_update").status_code == 200
    reply = engine.post(
        "update_weights_from_disk", {"model_path": str(engine.other), "weight_version": "disk-1"}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["success"] is True and body["num_paused_requests"] == 0
    assert body["message"].startswith("Succeeded to update model weights") and "disk-1" in body["message"]
    assert engine.post("end_weight_update").status_code == 200
    info = engine.get("get_model_info").json()
    assert info["model_path"] == str(engine.other) and info["weight_version"] == "disk-1"
    changed = engine.generate(PROMPT, params, return_logprob=True)
    lp = [t[0] for t in changed["meta_info"]["output_token_logprobs"]]
    assert lp != [t[0] for t in original["meta_info"]["output_token_logprobs"]]
    # Outside a session disk loads are allowed; back to the original weights, same greedy answer.
    assert engine.post("update_weights_from_disk", {"model_path": str(engine.model)}).status_code == 200
    assert engine.generate(PROMPT, params)["output_ids"] == original["output_ids"]


def test_update_weights_from_disk_flush_and_errors(engine: Engine) -> None:
    job = Background(engine, LONG)
    engine.wait_running(1)
    assert engine.post("pause_generation", {"mode": "in_place"}).status_code == 200
    path = str(engine.model)  # the weights it already has: nothing changes for the running request
    refused = engine.post("update_weights_from_disk", {"model_path": path})
    assert refused.status_code == 400
    assert refused.json()["success"] is False and refused.json()["message"].startswith(NOT_FLUSHED)
    assert refused.json()["num_paused_requests"] == 0
    kept = engine.post("update_weights_from_disk", {"model_path": path, "flush_cache": False})
    assert kept.status_code == 200 and kept.json()["success"] is True
    assert engine.post("continue_generation").status_code == 200
    assert job.join()["meta_info"]["finish_reason"]["type"] == "length"
    missing = engine.post("update_weights_from_disk", {})
    assert (
        missing.status_code == 400
        and missing.json()["object"] == "error"
        and "model_path" in missing.json()["message"]
    )
    bad = engine.post("update_weights_from_disk", {"model_path": str(engine.model / "nonexistent")})
    assert (
        bad.status_code == 400 and bad.json()["success"] is False and bad.json()["num_paused_requests"] == 0
    )
    assert engine.get("get_model_info").json()["model_path"] == path


# ---------------------------------------------------------------------- the client's parsing


def test_client_parses_sglang_reply_shapes(engine: Engine) -> None:
    client = FleetClient([engine.url], admin_api_key=ADMIN_KEY)

    async def scenario() -> None:
        [flushed] = await client.control("flush_cache")
        assert isinstance(flushed, str) and flushed.startswith(FLUSHED_PREFIX)  # plain text
        assert await client.control("abort_request", {"abort_all": True}) == [None]  # empty body
        assert await client.control("pause_generation", {"mode": "retract"}) == [PAUSED]
        assert await client.control("continue_generation") == [CONTINUED]
        for endpoint, payload, needle in [
            ("end_weight_update", {}, "HTTP 400: no weight-update session is open"),
            ("update_weights_from_disk", {}, "model_path"),
            ("update_weights_from_tensor", {"serialized_named_tensors": ["eA=="]}, "begin_weight_update()"),
        ]:
            with pytest.raises(SlimError) as info:
                await client.control(endpoint, payload)
            assert needle in str(info.value) and "\n" not in str(info.value)
        with pytest.raises(SlimError, match="HTTP 404: Not Found"):
            await client.query("get_weight_version")
        await client.close()

    run(scenario)


def test_admin_key_guards_control_calls_not_generation(engine: Engine) -> None:
    for header in ({}, {"Authorization": "Bearer wrong"}):
        refused = requests.post(f"{engine.url}/flush_cache", json={}, headers=header, timeout=30)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 1}}
    assert requests.post(f"{engine.url}/generate", json=body, timeout=60).status_code == 200
    assert requests.get(f"{engine.url}/get_model_info", timeout=30).status_code == 200
    assert requests.get(f"{engine.url}/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------- memory release (colocation)

BOTH_TAGS = {"tags": ["weights", "kv_cache"]}


def _logprobs(out: dict[str, Any]) -> list[float | None]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_weights_checker_finds_every_tensor_an_update_did_not_write(engine: Engine) -> None:
    """SGLang's `/weights_checker`: snapshot, reset to random, reload, compare. Only a tensor the
    reload wrote back compares equal; per-tensor checksums follow the weights."""
    first = engine.post("weights_checker", {"action": "checksum"})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["success"] is True and len(body["ranks"]) == 1
    checksums = body["ranks"][0]["checksums"]
    assert len(checksums) >= 10 and all(len(c) == 16 and int(c, 16) >= 0 for c in checksums.values())
    assert len(body["per_engine_checksum"]) == 64
    for action in ("snapshot", "reset_tensors"):
        reply = engine.post("weights_checker", {"action": action}).json()
        assert reply == {"success": True, "message": "Success."}
    reset = engine.post("weights_checker", {"action": "checksum"}).json()["ranks"][0]["checksums"]
    assert all(reset[name] != checksums[name] for name in checksums)
    refused = engine.post("weights_checker", {"action": "compare"})
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "check tensor equality failed" in refused.json()["message"]
    assert "name=" in refused.json()["message"] and "max_abs_err=" in refused.json()["message"]
    assert engine.post("update_weights_from_disk", {"model_path": str(engine.model)}).status_code == 200
    compared = engine.post("weights_checker", {"action": "compare"})
    assert compared.status_code == 200 and compared.json()["success"] is True, compared.text
    again = engine.post("weights_checker", {"action": "checksum"}).json()
    assert again["ranks"][0]["checksums"] == checksums
    assert again["per_engine_checksum"] == body["per_engine_checksum"]
    # compare consumed the snapshot (SGLang drops it on success)
    assert engine.post("weights_checker", {"action": "compare"}).status_code == 400


def test_released_weights_are_lost_until_an_update_is_pushed(engine: Engine) -> None:
    """As SGLang's memory saver on a GPU: after release + resume the weights are garbage (NaN on
    CPU: the logits are NaN, greedy picks token 0, the NaN logprobs are JSON null); the weights
    pushed after the resume bring the exact answer back."""
    params = {**GREEDY, "max_new_tokens": 4}
    good = engine.generate(PROMPT, params, return_logprob=True)
    for endpoint in ("release_memory_occupation", "resume_memory_occupation"):
        reply = engine.post(endpoint, BOTH_TAGS)
        assert reply.status_code == 200 and reply.json() is None, reply.text
    lost = engine.generate(PROMPT, params, return_logprob=True)
    assert _logprobs(lost) == [None] * 4 and lost["output_ids"] == [0] * 4
    pushed = engine.post("update_weights_from_disk", {"model_path": str(engine.model)})
    assert pushed.status_code == 200, pushed.text
    again = engine.generate(PROMPT, params, return_logprob=True)
    assert again["output_ids"] == good["output_ids"] and _logprobs(again) == _logprobs(good)


@pytest.mark.parametrize("kind", ENGINES)
def test_backed_up_weights_survive_and_resuming_what_is_held_kills_the_server(
    kind: str, tiny_model, tmp_path: Path
) -> None:
    """With `rollout.sglang.weights_cpu_backup` (SGLang's `--enable-weights-cpu-backup`) released
    weights come back exactly. Resuming a tag the engine holds is fatal, as in SGLang (its
    scheduler's `offload_tags.remove` raises KeyError): no reply, an error in the log, and the
    server process is gone, so an orchestrator that gets the order wrong finds out."""
    model = tiny_model("qwen3_moe")
    server = start_engine(kind, model, tmp_path, 0, "rollout.sglang.weights_cpu_backup=true")
    try:
        url, params = server.url, {**GREEDY, "max_new_tokens": 4}
        body = {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True}
        good = requests.post(f"{url}/generate", json=body, timeout=120).json()
        assert all(isinstance(lp, float) and math.isfinite(lp) for lp in _logprobs(good))
        for endpoint in ("release_memory_occupation", "resume_memory_occupation"):
            assert requests.post(f"{url}/{endpoint}", json=BOTH_TAGS, timeout=60).status_code == 200
        kept = requests.post(f"{url}/generate", json=body, timeout=120).json()
        assert kept["output_ids"] == good["output_ids"] and _logprobs(kept) == _logprobs(good)
        with pytest.raises(requests.ConnectionError):
            requests.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]}, timeout=60)
        assert server.process is not None and server.process.wait(timeout=60) != 0
        assert "KeyError: 'weights'" in server.log_path.read_text(errors="replace")
    finally:
        server.stop()
