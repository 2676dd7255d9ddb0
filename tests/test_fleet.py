"""The rollout fleet with real processes: `slimrl serve` engines behind the real sglang-router.

Nothing is mocked: the engines, the router and HTTP are the production ones. One fleet (two
engines and the router) serves the module; the engine-death test replaces one of its engines, and
the last test stops it and checks that every process it ever started is gone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import psutil
import pytest
import requests

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError
from slimrl.preflight import load_config
from slimrl.rollout.client import FleetClient, RequestTimedOut
from slimrl.rollout.fleet import Fleet
from slimrl.rollout.servers import server_command
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow
T = TypeVar("T")
LONG = {"temperature": 1.0, "ignore_eos": True}
LAYERS, TOP_K = 2, 2  # the tiny qwen3_moe: 2 MoE layers, 2 experts per token


def fleet_config(model: Path, data: Path, *overrides: str) -> SlimConfig:
    return load_config(
        "configs/tiny_moe_cpu.yaml",
        [
            f"model.hf_checkpoint={model}",
            f"data.prompt_data={data}",
            "algorithm.loss=policy",
            "rollout.num_engines=2",
            "rollout.router.enabled=true",
            *overrides,
        ],
    )


def run(client: FleetClient, coroutine: Awaitable[T]) -> T:
    """Run one coroutine on a fresh loop and close the client's session for that loop."""

    async def main() -> T:
        try:
            return await coroutine
        finally:
            await client.close()

    return asyncio.run(main())


def process_tree(pids: list[int]) -> set[int]:
    """The given pids and all their live descendants."""
    found = set(pids)
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            found |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
    return found


def alive(pids: set[int]) -> set[int]:
    """Pids that still run (zombies count as gone: they have exited)."""
    live = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.add(pid)
        except psutil.NoSuchProcess:
            pass
    return live


def load(url: str) -> int:
    """Requests running or waiting on one engine."""
    return requests.get(f"{url}/get_load", timeout=5).json()[0]["num_reqs"]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class TrackedFleet(Fleet):
    """A Fleet that remembers every process (and child process) it ever started."""

    started: set[int]

    def track(self) -> None:
        self.started = getattr(self, "started", set()) | process_tree(self.pids())


@pytest.fixture(scope="module")
def fleet(tiny_model, mod_sum_data, tmp_path_factory) -> Iterator[TrackedFleet]:
    config = fleet_config(tiny_model("qwen3_moe"), mod_sum_data, "rollout.request_timeout_s=60")
    fleet = TrackedFleet(config, str(tiny_model("qwen3_moe")), tmp_path_factory.mktemp("fleet") / "logs")
    fleet.start()
    fleet.track()
    try:
        yield fleet
    finally:
        fleet.stop()


def direct_client(fleet: Fleet, **kwargs: Any) -> FleetClient:
    """A client of the same engines without the router (client-side routing only)."""
    assert fleet.client is not None
    return FleetClient(fleet.client.engines, **kwargs)


def assert_sglang_shape(response: dict[str, Any], rid: str, prompt: list[int], max_new: int) -> None:
    meta = response["meta_info"]
    assert set(response) >= {"text", "output_ids", "meta_info"}
    assert meta["id"] == rid
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(response["output_ids"]) <= max_new
    assert meta["weight_version"] is not None
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == response["output_ids"]
    assert all(isinstance(t[0], float) and t[0] <= 0.0 and t[2] is None for t in triples)


def test_router_lists_both_engines_healthy(fleet: TrackedFleet) -> None:
    assert fleet.router is not None and fleet.client is not None
    workers = fleet.router.workers()
    assert sorted(w["url"] for w in workers) == sorted(fleet.client.engines)
    assert len(workers) == 2 and all(w["is_healthy"] for w in workers)
    assert fleet.client.router_url == fleet.router.url


def test_router_launcher_reads_our_arguments_as_sglang_routers_own_does() -> None:
    """`slimrl.rollout.router_main` turns the router command we build into the same settings as
    sglang-router's own launcher, without importing SGLang (6.5 s of CPU at every start)."""
    code = (
        "import sys\n"
        "from slimrl.rollout import router_main\n"
        "from slimrl.rollout.router import router_command\n"
        "argv = router_command('127.0.0.1', 4321, '/models/m', 'cache_aware')\n"
        "argv = argv[argv.index('slimrl.rollout.router_main') + 1:]\n"
        "ours = router_main.parse(argv)\n"
        "print('sglang' in sys.modules)\n"
        "from sglang_router.launch_router import parse_router_args\n"
        "print(ours == parse_router_args(argv), ours.port, ours.policy, ours.disable_retries)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["False", "True 4321 cache_aware True"], proc.stdout


def test_generate_via_router_and_client_side_in_sglang_shapes(fleet: TrackedFleet) -> None:
    client = fleet.client
    assert client is not None
    prompt = [23, 15, 24, 33]
    params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 7}
    before = client.requests_via_router
    routed = run(
        client, client.generate(input_ids=prompt, sampling_params=params, return_logprob=True, rid="a1")
    )
    assert client.requests_via_router == before + 1
    direct = direct_client(fleet)
    answer = run(
        direct, direct.generate(input_ids=prompt, sampling_params=params, return_logprob=True, rid="a2")
    )
    assert direct.requests_direct == 1 and direct.requests_via_router == 0
    assert_sglang_shape(routed, "a1", prompt, 12)
    assert_sglang_shape(answer, "a2", prompt, 12)
    # Same seed, same weights: the same tokens whichever way (and whichever engine) served it.
    assert routed["output_ids"] == answer["output_ids"]
    text = run(client, client.generate(text="3+4=", sampling_params={"max_new_tokens": 2}))
    assert text["meta_info"]["prompt_tokens"] == 4 and len(text["output_ids"]) <= 2


def test_routed_experts_bypass_the_router(fleet: TrackedFleet) -> None:
    client = fleet.client
    assert client is not None
    assert client.router_dropped == {"return_routed_experts"}  # measured at start-up
    via_router, direct = client.requests_via_router, client.requests_direct
    prompt = [23, 15, 24, 33]
    response = run(
        client,
        client.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
            return_routed_experts=True,
        ),
    )
    assert client.requests_via_router == via_router and client.requests_direct == direct + 1
    rows = np.frombuffer(base64.b64decode(response["meta_info"]["routed_experts"]), dtype="<i4")
    # One row per token the model saw: prompt + generated - 1 (the last token is never fed).
    assert rows.size == (len(prompt) + 5 - 1) * LAYERS * TOP_K
    assert rows.min() >= 0 and rows.max() < 4


def test_control_calls_reach_every_engine(fleet: TrackedFleet) -> None:
    client = fleet.client
    assert client is not None
    urls = list(client.engines)
    answers = run(
        client, client.control("update_weight_version", {"new_version": "v7", "abort_all_requests": False})
    )
    assert len(answers) == 2 and all(a["success"] for a in answers)
    infos = run(client, client.query("get_model_info"))  # SGLang 0.5.23 has no /get_weight_version
    assert [info["weight_version"] for info in infos] == ["v7"] * 2
    routed = run(client, client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1}))
    assert routed["meta_info"]["weight_version"] == "v7"

    # pause: every engine stops taking work (`/ready` is 503) and a request waits until continue.
    async def paused_request() -> tuple[list[int], dict[str, Any]]:
        await client.control("pause_generation", {"mode": "in_place"})
        codes = [requests.get(f"{u}/ready", timeout=5).status_code for u in urls]
        task = asyncio.create_task(client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2}))
        await asyncio.sleep(0.5)
        assert not task.done(), "generation ran while every engine was paused"
        await client.control("continue_generation")
        return codes, await task

    codes, response = run(client, paused_request())
    assert codes == [503, 503]
    assert response["meta_info"]["finish_reason"]["type"] == "length"
    assert all(requests.get(f"{u}/ready", timeout=5).status_code == 200 for u in urls)

    # abort: one long request per engine (client-side routing spreads them), aborted by rid prefix:
    # the client sends each exact rid it has in flight (engines ignore a prefix, as SGLang).
    direct = direct_client(fleet)

    async def aborted() -> tuple[list[Any], list[dict[str, Any]]]:
        params = {**LONG, "max_new_tokens": 400}
        tasks = [
            asyncio.create_task(
                direct.generate(input_ids=[5, 6, 7], sampling_params=params, rid=f"stop-me-{i}")
            )
            for i in range(2)
        ]
        await asyncio.to_thread(wait_for, lambda: all(load(u) == 1 for u in urls), 30, "both engines busy")
        ignored = await direct.control("abort_request", {"rid": "stop-me-"})
        await asyncio.sleep(0.2)
        assert ignored == [None, None] and not any(t.done() for t in tasks)  # empty bodies, nothing hit
        await direct.abort("stop-me-")
        return ignored, await asyncio.gather(*tasks)

    _, responses = run(direct, aborted())
    for response in responses:
        assert response["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(response["output_ids"]) < 400  # partial output comes back with the abort


def test_malformed_request_is_one_line_slim_error(fleet: TrackedFleet) -> None:
    client = fleet.client
    assert client is not None
    failovers = client.failovers
    cases = [
        (client, {"temperature": "hot"}, "temperature"),  # the router refuses it (422, plain text)
        (direct_client(fleet), {"top_k": 0}, "top_k"),  # the engine refuses it (400, JSON)
        (direct_client(fleet), {"bogus": 1}, "bogus"),
    ]
    for target, params, needle in cases:
        with pytest.raises(SlimError) as info:
            run(target, target.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2, **params}))
        message = str(info.value)
        assert "\n" not in message and needle in message and "/generate rejected by" in message
        assert not target.down
    assert client.failovers == failovers  # a 4xx is not retried


def test_control_call_marks_an_unreachable_engine_down(fleet: TrackedFleet) -> None:
    """A dead engine must not end the run from a control call (memory release, pause): it is
    marked down, the live engines still get the call, and the heal step restarts it later."""
    live = fleet.servers[0].url
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = FleetClient([live, dead])
    results = run(client, client.query("get_model_info"))
    assert client.down == {dead}
    assert isinstance(results[0], dict) and results[1] is None
    assert client.live_engines() == [live]
    assert run(client, client.query("get_model_info")) == results[:1]  # only the live one now


def test_request_timeout_raises_and_aborts_on_the_engine(fleet: TrackedFleet) -> None:
    url = fleet.servers[0].url
    patient, impatient = FleetClient([url]), FleetClient([url], request_timeout_s=0.3)
    params = {**LONG, "max_new_tokens": 500}

    async def timed_out_among_busy_neighbours() -> float:
        # Eight long requests keep the engine busy for seconds, so the load only drops to 8 if the
        # timed-out ninth is really taken off the engine.
        neighbours = [
            asyncio.create_task(patient.generate(input_ids=[5, 6, i], sampling_params=params, rid=f"bg-{i}"))
            for i in range(8)
        ]
        await asyncio.to_thread(wait_for, lambda: load(url) == 8, 30, "eight running requests")
        start = time.monotonic()
        with pytest.raises(RequestTimedOut, match=r"request_timeout_s=0\.3"):
            await impatient.generate(input_ids=[5, 6, 7], sampling_params=params)
        elapsed = time.monotonic() - start
        await asyncio.to_thread(wait_for, lambda: load(url) == 8, 2, "the timed-out request to be aborted")
        await patient.abort("bg-")
        await asyncio.gather(*neighbours)
        await impatient.close()
        return elapsed

    assert run(patient, timed_out_among_busy_neighbours()) < 2.0


def test_engine_death_mid_rollout_fails_over_then_heal_swaps_in_a_new_engine(fleet: TrackedFleet) -> None:
    client = fleet.client
    assert client is not None and fleet.router is not None
    victim = fleet.servers[1]
    old_url, failovers = victim.url, client.failovers

    async def sixteen_with_a_crash() -> list[dict[str, Any]]:
        params = {**LONG, "max_new_tokens": 150}
        tasks = [
            asyncio.create_task(
                client.generate(input_ids=[5, 6, 7 + i], sampling_params=params, rid=f"crash-{i}")
            )
            for i in range(16)
        ]
        urls = [s.url for s in fleet.servers]
        await asyncio.to_thread(wait_for, lambda: all(load(u) >= 4 for u in urls), 30, "both engines busy")
        victim.kill()
        return await asyncio.gather(*tasks)

    responses = run(client, sixteen_with_a_crash())
    assert len(responses) == 16
    for response in responses:
        assert response["meta_info"]["finish_reason"]["type"] == "length"
        assert len(response["output_ids"]) == 150  # re-run from scratch on the surviving engine
    assert client.failovers > failovers and old_url in client.down

    new_urls = fleet.heal()
    fleet.track()
    assert len(new_urls) == 1 and new_urls[0] != old_url and fleet.restarts == 1
    new_url = new_urls[0]
    assert sorted(w["url"] for w in fleet.router.workers()) == sorted([fleet.servers[0].url, new_url])
    assert new_url in client.engines and old_url not in client.engines and not client.down

    async def busy_new_engine() -> None:
        params = {**LONG, "max_new_tokens": 300}
        tasks = [
            asyncio.create_task(client.generate(input_ids=[5, 6], sampling_params=params)) for _ in range(4)
        ]
        await asyncio.to_thread(wait_for, lambda: load(new_url) >= 1, 30, "a request on the new engine")
        await asyncio.gather(*tasks)

    run(client, busy_new_engine())  # through the router: round robin reaches the new engine


def test_a_failed_start_stops_what_it_started(fleet: TrackedFleet, mod_sum_data, tmp_path) -> None:
    """An engine that cannot load its model: start() raises one line and stops the router too."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    (tmp_path / "not_a_model").mkdir()
    config = fleet_config(Path(fleet.model_path), mod_sum_data, "rollout.num_engines=1")
    broken = Fleet(config, str(tmp_path / "not_a_model"), tmp_path / "logs")
    with pytest.raises(SlimError, match="engine0 exited with code") as info:
        broken.start()
    assert "\n" not in str(info.value) and "engine0.log" in str(info.value)
    started = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not alive(started) and not broken.servers and broken.router is None


def test_servers_die_with_a_killed_driver() -> None:
    """A driver killed with SIGKILL cannot stop its servers; the kernel does (parent-death signal)."""
    script = (
        "import sys, time\n"
        "from slimrl.rollout.servers import ServerProcess\n"
        "s = ServerProcess(name='s', command=[sys.executable, '-c', 'import time; time.sleep(60)'],"
        " host='127.0.0.1', port=1)\n"
        "s.start()\nprint(s.process.pid, flush=True)\ntime.sleep(60)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert driver.stdout is not None
    server = int(driver.stdout.readline())
    assert alive({server})
    driver.kill()
    driver.wait(10)
    wait_for(lambda: not alive({server}), timeout=5, what="the orphaned server to exit")


def test_sglang_command_builder() -> None:
    config = SlimConfig()
    config.cluster.device = "cuda"  # the GPU command line (a CPU one has no GPU ids)
    config.rollout.engine = "sglang"
    config.rollout.gpus_per_engine = 2
    config.rollout.api_key = "k"
    cmd, env = server_command(config, "/ckpt/hf", "10.0.0.5", 30001, index=1)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--model-path") == "/ckpt/hf" and flag("--host") == "10.0.0.5" and flag("--port") == "30001"
    assert flag("--tp-size") == "2" and flag("--base-gpu-id") == "2"  # engine 1 starts at GPU 2
    assert flag("--api-key") == "k" and env == {}
    embedded, embedded_env = server_command(SlimConfig(), "/ckpt/hf", "127.0.0.1", 30002, index=0)
    assert embedded[1:4] == ["-m", "slimrl.cli", "serve"] and embedded_env == {"OMP_NUM_THREADS": "1"}


def test_router_death_falls_back_to_client_side_routing(fleet: TrackedFleet) -> None:
    client = fleet.client
    assert client is not None and fleet.router is not None
    fleet.router.process.kill()
    direct = client.requests_direct
    for _ in range(3):
        response = run(client, client.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2}))
        assert len(response["output_ids"]) <= 2
    assert client.router_down and client.requests_direct == direct + 3 and not client.down


def test_stop_leaves_no_process_behind(fleet: TrackedFleet) -> None:
    fleet.track()
    started = set(fleet.started)
    assert len(started) >= 4  # 2 engines + the router + the engine that replaced a dead one
    assert len(alive(started)) >= 2  # the two engines (the router was killed above)
    fleet.stop()
    wait_for(lambda: not alive(started), timeout=5, what="every started process to exit")
    fleet.stop()  # idempotent
