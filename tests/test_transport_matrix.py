"""The transport x layout matrix against real SGLang 0.5.23 on CPU: `tensor`, `distributed` and
`disk` from trainer layouts that are the shipped shapes scaled down (TP2 x EP2, PP2 x EP2, and TP2
with expert-TP 1 over EP2), colocated and disaggregated. Every update the device ledger accepts
completes within its deadline (a hang would be one line naming every rank's wait) and leaves the
engine scoring like the trainer; every one the GPU would refuse is refused by the ledger at load
and by the transport before it opens anything. Buckets of 20 kB force every unit into many.

The export runs with sends as strict as NCCL's (a send returns only once received), so an order
that could deadlock on GPUs deadlocks here; `test_weight_sync_order.py` model-checks the same
schedule at the shipped full layouts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from slimrl.devices.rank_groups import Sizes
from slimrl.rollout.servers import ServerProcess, server_command
from tests.conftest import PYTHON, REPO, free_port
from tests.engines import assert_real_sglang, assert_sglang_log, engine_config
from tests.netns_hosts import Hosts, network_hosts
from tests.test_weight_sync import run_segments, shm_segments
from tests.test_weight_sync_order import check_trace_against_model

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "matrix_worker.py"
SYNCED = 1e-5  # real SGLang in float32 scores within this of the trainer after a sync
LAYOUTS = {  # name: (ranks, overrides, sizes (tp, pp, cp, ep, etp, dp))
    "tp2_ep2": (4, ["parallel.tp=2", "parallel.ep=2"], Sizes(2, 1, 1, 2, 2, 2)),
    "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2"], Sizes(1, 2, 1, 2, 1, 2)),
    "tp2_etp1_ep2": (2, ["parallel.tp=2", "parallel.etp=1", "parallel.ep=2"], Sizes(2, 1, 1, 2, 1, 1)),
}
ONE_HOST = [
    {"mode": "colocated", "transport": "tensor", "expect": "ok"},
    # trainer rank 0 and the engine on one device in one NCCL group
    {"mode": "colocated", "transport": "distributed", "expect": "refused"},
    {"mode": "colocated", "transport": "disk", "expect": "ok"},
    {"mode": "disaggregated", "transport": "distributed", "expect": "ok"},
    {"mode": "disaggregated", "transport": "tensor", "expect": "ok"},  # references within the node
    {"mode": "disaggregated", "transport": "disk", "expect": "ok"},
]


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    """Two real SGLang servers, started together: engine 1's ranks sit at a group rank offset and,
    colocated, on trainer rank 1's device."""
    model = tiny_model("qwen3_moe")
    log_dir = tmp_path_factory.mktemp("matrix_engines")
    config = engine_config("sglang", model)
    servers = []
    try:
        for index in range(2):
            port = free_port()
            cmd, env = server_command(config, str(model), "127.0.0.1", port, index)
            servers.append(ServerProcess(f"engine{index}", cmd, "127.0.0.1", port, env=env,
                                         log_path=log_dir / f"engine{index}.log"))  # fmt: skip
            servers[-1].start()
        for server in servers:
            server.wait_healthy(300)
            assert_real_sglang(server.url, server.process.pid if server.process else None)
        yield model, [s.url for s in servers]
    finally:
        for server in servers:
            server.stop()


def base_overrides(model, nproc: int, layout: list[str]) -> list[str]:
    return [
        f"model.hf_checkpoint={model}", "rollout.engine=sglang", f"cluster.gpus_per_node={nproc}",
        "train.optimizer.lr=0.05", "rollout.update_weight_buffer_bytes=20000", *layout,
    ]  # fmt: skip


def worker_args(tmp_path, urls, plan, base) -> list[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return [str(WORKER), str(out), ",".join(urls), str(tmp_path / "sync"), json.dumps(plan), *base]


def run_matrix(tmp_path, urls, model, nproc, layout, plan) -> list[dict]:
    args = worker_args(tmp_path, urls, plan, base_overrides(model, nproc, layout))
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert "HUNG:" not in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads((tmp_path / "out" / "rank0.json").read_text())


def check_outcomes(results: list[dict], sizes: Sizes) -> None:
    for index, r in enumerate(results):
        name = f"{r['mode']} {r['transport']}"
        if r["expect"] == "refused":
            assert r["load"].startswith("GPU rule"), (name, r["load"])
            assert r["push"] == r["load"], name  # the transport refuses as the load did
            continue
        assert r["load"] == "accepted" and r["push"] == "done", (name, r)
        assert r["diff"] <= SYNCED, (name, r["diff"])
        assert r["moved"] > 1e-3, (name, "the engine kept the old weights")
        assert set(r["versions"]) == {f"v{index + 1}"}, name
        check_trace_against_model(r["trace"], sizes)  # NCCL's rules on the real calls


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_transport_from_every_layout_on_one_host(tmp_path, engine, layout):
    model, urls = engine
    nproc, overrides, sizes = LAYOUTS[layout]
    before = shm_segments()
    results = run_matrix(tmp_path, urls, model, nproc, overrides, ONE_HOST)
    # every bucket's segment is unlinked once its last reader is done; an engine may still map the
    # last one it loaded from each rank that served it
    left = run_segments(shm_segments() - before, json.loads((tmp_path / "out" / "pids.json").read_text()))
    assert len(left) <= len(urls) * nproc, sorted(left)[:5]
    print(layout, [(r["mode"], r["transport"], r.get("diff"), r.get("seconds")) for r in results])
    check_outcomes(results, sizes)
    refused = next(r for r in results if r["expect"] == "refused")
    assert "trainer/0 and engine/0/tp0 are both on node0 slot 0 in the weight_sync group" in refused["load"]
    assert all(len(r.get("versions", urls)) == len(urls) for r in results)  # both engines, every time


TWO_HOSTS = [
    # each engine maps the memory of the trainer rank on its own host
    {"mode": "colocated", "transport": "tensor", "expect": "ok", "hosts": 2},
    {"mode": "colocated", "transport": "distributed", "expect": "refused", "hosts": 2},
    {"mode": "colocated", "transport": "disk", "expect": "ok", "hosts": 2},
]


def start_on_host(hosts: Hosts, k: int, model, log_dir) -> ServerProcess:
    config = engine_config("sglang", model)
    port = free_port()
    cmd, env = server_command(config, str(model), hosts.address(k), port, k - 1)
    server = ServerProcess(f"engine{k}", hosts.command(k, *cmd), hosts.address(k), port,
                           env={**env, **hosts.env}, log_path=log_dir / f"engine{k}.log")  # fmt: skip
    server.start()
    return server


def rank_env(hosts: Hosts, rank: int, world: int, port: int) -> dict[str, str]:
    """Rank `rank` on host rank + 1, meeting at host 1 (what torchrun's environment would say)."""
    return {
        **os.environ, **hosts.env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
        "MASTER_ADDR": hosts.address(1), "MASTER_PORT": str(port),
    }  # fmt: skip


def test_colocated_over_two_hosts_each_engine_maps_its_own_hosts_rank(tmp_path, tiny_model):
    """TP2 with expert-TP 1 over EP2: rank 0 and engine 0 on one host, rank 1 and engine 1 on the
    other (real SGLang each, on its host's address); `tensor` hands each engine references from the
    rank on its own host only, `distributed` is refused, `disk` goes through the shared filesystem."""
    model = tiny_model("qwen3_moe")
    nproc, overrides, sizes = LAYOUTS["tp2_etp1_ep2"]
    with network_hosts(2) as hosts:
        servers = [start_on_host(hosts, k, model, tmp_path) for k in (1, 2)]
        try:
            for server in servers:
                server.wait_healthy(300)
                assert_real_sglang(server.url)  # its process runs inside the host's namespace
                assert_sglang_log(tmp_path / f"{server.name}.log")
            args = worker_args(
                tmp_path, [s.url for s in servers], TWO_HOSTS, base_overrides(model, nproc, overrides)
            )
            port = free_port()
            ranks = [
                subprocess.Popen(
                    hosts.command(rank + 1, PYTHON, *args),
                    env=rank_env(hosts, rank, nproc, port),
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for rank in range(nproc)
            ]
            outputs = [p.communicate(timeout=900)[0] for p in ranks]
            assert all(p.returncode == 0 for p in ranks), "\n".join(o[-3000:] for o in outputs)
        finally:
            for server in servers:
                server.stop()
    results = json.loads((tmp_path / "out" / "rank0.json").read_text())
    print("two hosts", [(r["mode"], r["transport"], r.get("diff"), r.get("seconds")) for r in results])
    check_outcomes(results, sizes)
