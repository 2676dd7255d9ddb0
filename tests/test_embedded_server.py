"""`slimrl serve` as a real subprocess on a free port, driven over real HTTP with SGLang's JSON shapes.

One server (started with an API key) serves the whole module; every test leaves it with the seed-0
weights and generation running. The last test shuts it down with SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import requests
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import slimrl
from slimrl.weight_sync import wire
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: Path
    other: Path

    def post(
        self, path: str, body: Any = None, *, auth: bool = True, timeout: float = 60
    ) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=AUTH if auth else {}, timeout=timeout)

    def get(self, path: str, *, auth: bool = True) -> requests.Response:
        return requests.get(self.url + path, headers=AUTH if auth else {}, timeout=30)

    def generate(self, body: dict[str, Any]) -> Any:
        response = self.post("/generate", body, auth=False)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    model, other = tiny_model("qwen3_moe"), tiny_model("qwen3_moe", seed=1)
    stderr_path = tmp_path_factory.mktemp("serve") / "stderr.log"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "slimrl.cli", "serve", "--model", str(model), "--port", str(port)]
    stderr = stderr_path.open("w")
    proc = subprocess.Popen(
        [*cmd, "--admin-api-key", API_KEY, "--max-running-requests", "32"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        cwd=REPO,
    )
    srv = Server(proc=proc, url=f"http://127.0.0.1:{port}", model=model, other=other)
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"server exited: {stderr_path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "server did not become healthy"
        try:
            if requests.get(srv.url + "/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    assert "ready at" in proc.stdout.readline()
    yield srv
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    stderr.close()


@pytest.fixture(scope="module")
def refs(server) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in (("seed0", server.model), ("seed1", server.other))
    }


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


PROMPT = [20, 30, 40, 50, 60]


def _out(server: Server, prompt: list[int] = PROMPT, n: int = 8) -> list[int]:
    return server.generate({"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": n}})[
        "output_ids"
    ]


def test_health_info_and_loads(server):
    assert server.get("/health", auth=False).status_code == 200
    assert server.get("/health_generate", auth=False).status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path, auth=False).json()
        assert info["model_path"] == str(server.model) and info["is_generation"] is True
        assert info["weight_version"] == "default"
    for path in ("/get_server_info", "/server_info"):
        info = server.get(path, auth=False).json()
        assert (info["tp_size"], info["dp_size"], info["pp_size"], info["ep_size"]) == (1, 1, 1, 1)
        assert info["port"] == int(server.url.rsplit(":", 1)[1]) and info["host"] == "127.0.0.1"
        assert info["model_path"] == str(server.model) and "api_key" not in info
        # its own name and version, never SGLang's: no test of real SGLang can pass on it
        assert (info["engine"], info["version"], info["api_level"]) == (
            "slimrl-embedded",
            slimrl.__version__,
            "sglang 0.5.23",
        )
    load = server.get("/get_load", auth=False).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    loads = server.get("/v1/loads?include=core", auth=False).json()["loads"]
    assert loads[0]["num_running_reqs"] == 0 and loads[0]["num_waiting_reqs"] == 0


def test_generate_single_and_batch_in_sglang_shapes(server, refs):
    body = {
        "input_ids": PROMPT,
        "rid": "single-1",
        "sampling_params": {**GREEDY, "max_new_tokens": 6, "stop": None, "stop_token_ids": None},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_routed_experts": True,
        "model": None,  # routers add keys like these: unknown top-level keys are ignored
        "stream": False,
        "log_metrics": True,
        "some_unknown_field": 123,
    }
    out = server.generate(body)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert out["output_ids"] == _greedy(refs["seed0"], PROMPT, 6)
    assert meta["id"] == "single-1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (5, 6, 0)
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(text is None and lp <= 0 for lp, _, text in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"][0] == [None, PROMPT[0], None]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT
    routed = torch.frombuffer(bytearray(base64.b64decode(meta["routed_experts"])), dtype=torch.int32)
    assert routed.numel() == (5 + 6 - 1) * 2 * 2 and meta["routed_experts_start_len"] == 0

    batch = server.generate(
        {
            "input_ids": [PROMPT, [7, 8, 9]],
            "sampling_params": [{**GREEDY, "max_new_tokens": 3}, {**GREEDY, "max_new_tokens": 5}],
            "rid": ["b-0", "b-1"],
        }
    )
    assert [item["meta_info"]["id"] for item in batch] == ["b-0", "b-1"]
    assert batch[0]["output_ids"] == _greedy(refs["seed0"], PROMPT, 3)
    assert batch[1]["output_ids"] == _greedy(refs["seed0"], [7, 8, 9], 5)
    assert "output_token_logprobs" not in batch[0]["meta_info"]
    texts = server.generate({"text": ["ab", "cd"], "sampling_params": {**GREEDY, "max_new_tokens": 2}})
    assert [item["meta_info"]["prompt_tokens"] for item in texts] == [2, 2]
    scored = server.generate(
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 2,
        }
    )
    assert scored["output_ids"] == [] and len(scored["meta_info"]["input_token_logprobs"]) == 3


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('{"input_ids": [1, 2', "malformed JSON"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "foo": 1}}, "`foo`"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
        ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": [5, 100000]}, "100000"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [5], "stream": True}, "stream"),
        ({"input_ids": [5], "sampling_params": {"n": 2}}, "n=2"),
        ([1, 2], "object"),
    ],
)
def test_bad_generate_requests_are_400_with_a_one_line_message(server, body, needle):
    if isinstance(body, str):
        response = requests.post(server.url + "/generate", data=body, timeout=30)
    else:
        response = server.post("/generate", body, auth=False)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert needle in message and "\n" not in message


def test_get_weights_by_name_bad_size_is_400_and_a_query_size_works(server):
    """Found by probing every control endpoint with malformed bodies: this one was a 500."""
    bad = server.post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "x"})
    assert bad.status_code == 400 and "truncate_size" in bad.json()["message"]
    good = server.get("/get_weights_by_name?name=model.norm.weight&truncate_size=2")
    assert good.status_code == 200 and len(good.json()) == 2


def test_concurrent_requests_equal_their_sequential_results(server):
    prompts = [[10 + i, 20 + 2 * i, 30 + i % 7] * (1 + i % 3) for i in range(16)]
    bodies = [
        {"input_ids": p, "sampling_params": {**GREEDY, "max_new_tokens": 6 + i % 5}}
        for i, p in enumerate(prompts)
    ]
    sequential = [server.generate(b)["output_ids"] for b in bodies]

    async def all_at_once() -> list[list[int]]:
        async with aiohttp.ClientSession() as session:

            async def one(body: dict) -> list[int]:
                async with session.post(server.url + "/generate", json=body) as response:
                    assert response.status == 200
                    return (await response.json())["output_ids"]

            return await asyncio.gather(*(one(b) for b in bodies))

    assert asyncio.run(all_at_once()) == sequential


def _in_background(fn) -> tuple[threading.Thread, dict]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=fn()), daemon=True)
    thread.start()
    return thread, box


def _wait_running(server: Server, n: int = 1) -> None:
    deadline = time.monotonic() + 30
    while server.get("/v1/loads", auth=False).json()["loads"][0]["num_running_reqs"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _long(rid: str) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "rid": rid,
        "sampling_params": {**GREEDY, "max_new_tokens": 500},
        "return_logprob": True,
    }


def _wait_decoding(server: Server, tokens: int) -> None:
    """Until the running request holds more than `tokens` tokens of KV (it has decoded some)."""
    deadline = time.monotonic() + 30
    while server.get("/v1/loads", auth=False).json()["loads"][0]["num_used_tokens"] <= tokens:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_abort_request_returns_the_partial_output(server, refs):
    """No fixed sleeps (a fast machine finishes 500 tokens in one): the request is caught decoding,
    and the abort endpoint answers after the scheduler applied it, so the load right after it
    tells whether the prefix abort touched the request."""
    thread, box = _in_background(lambda: server.post("/generate", _long("rollout-17-a"), auth=False))
    _wait_running(server)
    _wait_decoding(server, len(PROMPT))
    response = server.post("/abort_request", {"rid": "rollout-17"})  # a prefix: ignored, as SGLang
    assert response.status_code == 200 and response.content == b""
    assert server.get("/v1/loads", auth=False).json()["loads"][0]["num_running_reqs"] == 1
    response = server.post("/abort_request", {"rid": "rollout-17-a"})
    assert response.status_code == 200 and response.content == b""
    thread.join(30)
    result = box["result"]
    assert result.status_code == 200
    meta = result.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    n = meta["completion_tokens"]
    assert 0 < n < 500 and len(meta["output_token_logprobs"]) == n
    assert result.json()["output_ids"] == _greedy(refs["seed0"], PROMPT, n)


def test_pause_and_continue(server, refs):
    paused = {"message": "Generation paused successfully.", "status": "ok"}
    assert server.post("/pause_generation", {"mode": "in_place"}).json() == paused
    thread, box = _in_background(lambda: _out(server, PROMPT, 12))
    time.sleep(0.3)
    assert thread.is_alive()  # new requests wait while paused
    assert server.post("/continue_generation", {}).status_code == 200
    thread.join(30)
    assert box["result"] == _greedy(refs["seed0"], PROMPT, 12)

    thread, box = _in_background(lambda: server.post("/generate", _long("paused-1"), auth=False))
    _wait_running(server)
    assert server.get("/flush_cache").status_code == 400  # busy
    assert server.post("/pause_generation", {}).status_code == 200  # default mode: abort
    thread.join(30)
    assert box["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.get("/flush_cache").status_code == 200
    assert server.post("/continue_generation").status_code == 200


def test_release_and_resume_memory(server):
    assert server.post("/release_memory_occupation", {"tags": None}).status_code == 200
    response = server.post("/generate", {"input_ids": PROMPT}, auth=False)
    assert response.status_code == 503 and "resume" in response.json()["error"]["message"]
    assert server.post("/resume_memory_occupation", None).status_code == 200
    assert len(_out(server, PROMPT, 2)) == 2
    # The released weights came back as NaN (tests/test_memory_release.py): load them again.
    assert server.post("/update_weights_from_disk", {"model_path": str(server.model)}).status_code == 200


def test_update_weights_from_disk(server, refs):
    response = server.post(
        "/update_weights_from_disk", {"model_path": str(server.other), "weight_version": "3"}
    )
    assert response.status_code == 200 and response.json()["success"] is True
    out = server.generate({"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 8}})
    assert out["output_ids"] == _greedy(refs["seed1"], PROMPT, 8) != _greedy(refs["seed0"], PROMPT, 8)
    assert out["meta_info"]["weight_version"] == "3"
    assert server.get("/get_model_info", auth=False).json()["weight_version"] == "3"
    bad = server.post("/update_weights_from_disk", {"model_path": "/nonexistent/ckpt"})
    assert (
        bad.status_code == 400
        and bad.json()["success"] is False
        and "/nonexistent/ckpt" in bad.json()["message"]
    )
    assert server.post(
        "/update_weights_from_disk", {"model_path": str(server.model), "weight_version": "4"}
    ).ok
    assert _out(server) == _greedy(refs["seed0"], PROMPT, 8)


def test_update_weights_from_tensor_through_shared_memory(server, refs):
    other = load_file(str(server.other / "model.safetensors"))
    update = wire.tensor_update(sorted(other.items()), "5")
    body = update.body(1)
    payload = body["serialized_named_tensors"][0]
    assert len(payload) < 100_000  # names and shared-memory handles only: no weight bytes over HTTP
    assert server.post("/begin_weight_update", {}).status_code == 200  # SGLang 0.5.23 needs a session
    response = server.post("/update_weights_from_tensor", body)
    assert response.status_code == 200, response.text
    del update
    assert _out(server) == _greedy(refs["seed1"], PROMPT, 8)
    assert server.get("/get_model_info", auth=False).json()["weight_version"] == "5"

    base = load_file(str(server.model / "model.safetensors"))
    bad = wire.serialize([("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(1))])
    response = server.post(
        "/update_weights_from_tensor", {"serialized_named_tensors": [bad], "load_format": None}
    )
    assert response.status_code == 400 and "experts.9.up_proj" in response.json()["message"]
    restore = [(name, tensor) for name, tensor in base.items()]  # alive until the engine answered
    response = server.post(
        "/update_weights_from_tensor", {"serialized_named_tensors": [wire.serialize(restore)]}
    )
    assert response.status_code == 200
    assert server.post("/end_weight_update", {}).status_code == 200
    assert _out(server) == _greedy(refs["seed0"], PROMPT, 8)


def test_weights_over_a_gloo_group_with_the_test_as_rank_0(server, refs):
    port = free_port()
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "slimrl-test",
        "backend": "gloo",
    }
    thread, box = _in_background(lambda: server.post("/init_weights_update_group", init))
    group = wire.init_broadcast_group("127.0.0.1", port, 0, 2, "slimrl-test", "gloo", 60)
    thread.join(60)
    assert box["result"].status_code == 200, box["result"].text

    other = sorted(load_file(str(server.other / "model.safetensors")).items())
    meta = {
        "names": [n for n, _ in other],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in other],
        "shapes": [list(t.shape) for _, t in other],
        "group_name": "slimrl-test",
        "weight_version": "6",
    }
    assert server.post("/begin_weight_update", {}).status_code == 200  # SGLang 0.5.23 needs a session
    thread, box = _in_background(lambda: server.post("/update_weights_from_distributed", meta))
    for _, tensor in other:
        dist.broadcast(tensor.clone(), group=group, group_src=0)
    thread.join(60)
    assert box["result"].status_code == 200, box["result"].text
    assert _out(server) == _greedy(refs["seed1"], PROMPT, 8)

    base = sorted(load_file(str(server.model / "model.safetensors")).items())
    flat_meta = {**meta, "load_format": "flattened_bucket", "weight_version": "7"}
    thread, box = _in_background(lambda: server.post("/update_weights_from_distributed", flat_meta))
    dist.broadcast(
        wire.pack_for_broadcast([t for _, t in base], torch.device("cpu")), group=group, group_src=0
    )
    thread.join(60)
    assert box["result"].status_code == 200, box["result"].text
    assert server.post("/end_weight_update", {}).status_code == 200
    assert _out(server) == _greedy(refs["seed0"], PROMPT, 8)
    assert server.post("/destroy_weights_update_group", {"group_name": "slimrl-test"}).json()["success"]
    assert server.post("/destroy_weights_update_group", {"group_name": "slimrl-test"}).status_code == 400
    dist.destroy_process_group(group)


def test_api_key_guards_control_endpoints(server):
    for path in ("/flush_cache", "/abort_request", "/pause_generation", "/update_weights_from_disk"):
        response = server.post(path, {}, auth=False)
        assert response.status_code == 401, path
        assert response.json() == {"error": "Unauthorized"}  # SGLang's body
    wrong = requests.post(server.url + "/flush_cache", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    assert server.post(
        "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}, auth=False
    ).ok
    assert server.get("/get_server_info", auth=False).ok and server.get("/health", auth=False).ok
    assert server.post("/flush_cache", {}).status_code == 200


def test_sigterm_shuts_down_cleanly(server):
    """Runs last in this module: it stops the shared server."""
    proc = psutil.Process(server.proc.pid)
    children = proc.children(recursive=True)
    thread, box = _in_background(lambda: server.post("/generate", _long("at-shutdown"), auth=False))
    _wait_running(server)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(10) == 0
    assert time.monotonic() - start < 5
    thread.join(10)
    assert box["result"].status_code == 503  # the in-flight request was answered, not left hanging
    assert "shutting down" in box["result"].json()["error"]["message"]
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_the_routers_grpc_probe_is_refused_without_an_error_in_the_engine_log(caplog) -> None:
    """sglang-router 0.3.x sends every worker it registers an HTTP/2 preface (its gRPC probe):
    aiohttp answers 400 and, left alone, logs an ERROR with a traceback on each registration.
    The engine's filter drops exactly that record; the reply is the same 400."""
    from aiohttp import web

    from slimrl.rollout.embedded import server

    logger = logging.getLogger("aiohttp.server")
    for old in [f for f in logger.filters if isinstance(f, server._GrpcProbeFilter)]:
        logger.removeFilter(old)

    async def probe() -> bytes:
        runner = web.AppRunner(web.Application(), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            await writer.drain()
            status = await reader.readline()
            writer.close()
            return status
        finally:
            await runner.cleanup()

    def errors() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.ERROR]

    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        assert asyncio.run(probe()).startswith(b"HTTP/1.0 400")
        assert len(errors()) == 1 and "PRI/Upgrade" in str(errors()[0].exc_info[1])  # unfiltered
        caplog.clear()
        server.quiet_grpc_probes()
        server.quiet_grpc_probes()  # idempotent: one filter
        assert asyncio.run(probe()).startswith(b"HTTP/1.0 400")
        assert errors() == []
    assert sum(isinstance(f, server._GrpcProbeFilter) for f in logger.filters) == 1
