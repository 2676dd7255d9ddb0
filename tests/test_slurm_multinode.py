"""`sbatch slurm/grpo_moe_256gpu.sh` on a real Slurm cluster, one node and across two and three.

slurm/local/start_multinode.sh makes three hosts out of network namespaces (own address, hostname
and hosts file; the filesystem shared, as on a cluster), with slurmctld on the first and a slurmd
on each. The unchanged 32-node script is submitted with the command-line overrides that fit CPU
hosts. The jobs:

1. a node that cannot reach the head's address: the job fails within SLIMRL_RAY_WAIT_S, one line
   naming the node;
2. GRPO on 3 nodes, an EP2 trainer over the first two (rendezvous, gloo groups and checkpoint
   shards from both) and the engine on the third (rollouts, control calls and the `distributed`
   weight sync over the link), cancelled (scancel) after its first checkpoint: nothing is left on
   any node;
3. the same run resubmitted: it resumes from that checkpoint and completes; where every process
   ran, what it connected to and where every socket listened is watched from outside;
4. the 1-trainer-rank, 1-engine config on one node;
5. real SGLang on another node than the trainer, taking every update over the link, until every
   process of its node is killed (slurmd too): the run stops with one line naming the engine, its
   node and the checkpoint to resume from.

slurm/local/start_cluster.sh (the one-node cluster on the machine itself) gets a start/stop check.
Everything needs root; without it the tests fail in one line (`SLIMRL_ALLOW_MISSING_SLURM=1` skips
them on such a machine). See docs/slurm.md; the step and weight-sync
figures of 2 nodes against 1 come from bench/bench_slurm_multinode.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.engines import assert_sglang_log
from tests.slurm_cluster import (
    LOCAL,
    RAY_WORKER_PORTS,
    Cluster,
    ClusterUnavailable,
    HostWatcher,
    comm,
    exposed,
    grpo_overrides,
    job_env,
    job_processes,
    metrics,
    multinode_cluster,
    netns_pids,
    new_tag,
    sbatch_args,
    submit,
    submit_and_wait,
    tagged_processes,
)

pytestmark = pytest.mark.slow

ALLOW_MISSING = "SLIMRL_ALLOW_MISSING_SLURM"
"""Set to 1 on a machine that cannot run Slurm (no root): its tests are skipped there. CI never
sets it, so a Slurm that cannot be installed or started fails the suite in one line."""


def missing(why: str) -> None:
    if os.environ.get(ALLOW_MISSING) == "1":
        pytest.skip(why)
    pytest.fail(f"{why} (the Slurm tier must run here; {ALLOW_MISSING}=1 skips it on a machine without root)")


RAY_PORT = 6379  # each host has its own network stack: Ray's default port is free there
STEPS_AFTER_RESUME = 4


@pytest.fixture(scope="module")
def cluster():
    try:
        with multinode_cluster(hosts=3) as up:
            yield up
    except ClusterUnavailable as exc:
        missing(f"no local multi-host Slurm cluster here: {exc}")
    # Everything the start script made is gone.
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "slimrl-n" not in namespaces, namespaces
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "slimrl-n" not in links, links
    assert not Path("/run/slimrl-multinode").exists()


def _overrides(
    tiny_model, mod_sum_data, runs: Path, steps: int, slots_per_node: int, ep: int = 1
) -> list[str]:
    grpo = grpo_overrides(tiny_model("qwen3_moe"), mod_sum_data, runs, "grpo", steps, slots_per_node)
    return [*grpo, "checkpoint.save_interval=2", f"parallel.ep={ep}"]


_STAMPED = re.compile(r"^\[slimrl-slurm (\d\d):(\d\d):(\d\d)\] (.*)$", re.MULTILINE)


def _head(log: str) -> str:
    match = re.search(r"node\(s\) \(head (\S+) at ", log)
    assert match, log[-3000:]
    return match.group(1)


def _nothing_left(cluster: Cluster, tag: str) -> None:
    """No process of the job on any host, nor anywhere else on the machine."""
    deadline = time.monotonic() + 20
    while True:
        left = {node: job_processes(node) for node in cluster.nodes}
        left = {node: procs for node, procs in left.items() if procs}
        tagged = tagged_processes(tag)
        if not (left or tagged) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left and not tagged, (left, tagged)


def test_one_node_cluster_scripts():
    """start_cluster.sh / stop_cluster.sh: the node comes up idle, runs a step, and the daemons
    the script started are gone after the stop."""
    start = subprocess.run([str(LOCAL / "start_cluster.sh")], capture_output=True, text=True, timeout=900)
    if start.returncode == 3:
        missing(f"no local Slurm cluster here: {start.stderr.strip().splitlines()[-1]}")
    records = Path(os.environ.get("SLIMRL_SLURM_RUN_DIR", "/run/slimrl-local-slurm"))
    try:
        assert start.returncode == 0, start.stderr[-3000:]
        partition = start.stdout.split()[-1]
        env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
        step = subprocess.run(
            ["srun", f"--partition={partition}", "-N1", "hostname", "-s"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert step.returncode == 0 and step.stdout.strip() == os.uname().nodename.split(".")[0], step
        started = {rec.stem: rec.read_text().split()[0] for rec in records.glob("*.rec")}
    finally:
        stop = subprocess.run([str(LOCAL / "stop_cluster.sh")], capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr[-3000:]
    assert {"slurmctld", "slurmd"} <= started.keys(), started
    assert not list(records.glob("*.rec"))
    for name, pid in started.items():
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/comm").read_text().strip() != name


def test_node_that_cannot_reach_the_head_fails_in_one_line(cluster, tmp_path, tiny_model, mod_sum_data):
    """The head advertises an address of its own that the other node has no route to (its
    management link): the worker's `ray start` never joins, and the job fails within
    SLIMRL_RAY_WAIT_S naming that node."""
    head, worker = list(cluster.nodes)[:2]
    addrs = subprocess.run(
        ["ip", "-n", head, "-4", "-o", "addr", "show", "mgmt0"], capture_output=True, text=True
    )
    unreachable = addrs.stdout.split()[3].split("/")[0]
    # The wait bounds the head's own start too: under a loaded machine (the suite's other worker)
    # the head took over 10 s, and the job failed on the head instead of on the join.
    tag, wait_s = new_tag(), 30
    env = job_env(
        cluster, _overrides(tiny_model, mod_sum_data, tmp_path, 1, 1), tag,
        SLIMRL_HEAD_IP=unreachable, SLIMRL_RAY_WAIT_S=str(wait_s),
    )  # fmt: skip
    args = [*sbatch_args(cluster, 2, 1, tmp_path, f"slimrl-nojoin-{tag}"), f"--nodelist={head},{worker}"]
    job = submit_and_wait(cluster, env, args, tmp_path)
    assert job.returncode != 0 and cluster.final_state(job.job_id) == "FAILED", (job.stderr, job.log[-3000:])
    assert _head(job.log) == head
    errors = [line for line in job.log.splitlines() if "ERROR:" in line]
    assert len(errors) == 1, errors
    assert (
        f"node(s) {worker} did not join the head at {unreachable}:{RAY_PORT} within {wait_s} s" in errors[0]
    )
    # From the job's first line to the error: the head's start, the wait, and no more.
    stamped = [
        (int(h) * 3600 + int(m) * 60 + int(sec), rest) for h, m, sec, rest in _STAMPED.findall(job.log)
    ]
    error_at = next(t for t, rest in stamped if rest.startswith("ERROR:"))
    assert error_at - stamped[0][0] <= wait_s + 20, job.log[-3000:]
    assert not (tmp_path / "grpo").exists()  # slimrl never started
    _nothing_left(cluster, tag)
    shutil.rmtree(f"/tmp/slimrl-ray-{job.job_id}", ignore_errors=True)  # kept for debugging


def test_grpo_across_three_nodes_cancelled_and_resumed(cluster, tmp_path, tiny_model, mod_sum_data):
    head_node, second_node, engine_node = list(cluster.nodes)
    run_dir = tmp_path / "grpo"
    args = lambda tag: sbatch_args(cluster, 3, 1, tmp_path, f"slimrl-mn-{tag}")  # noqa: E731

    # 1. A long run, cancelled once its first checkpoint is complete.
    tag = new_tag()
    env = job_env(cluster, _overrides(tiny_model, mod_sum_data, tmp_path, 200, 1, ep=2), tag)
    job_id = submit(env, args(tag))
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not latest.exists():
        assert time.monotonic() < deadline and not cluster.final_state(job_id), (
            tmp_path / f"slurm-{job_id}.out"
        ).read_text()[-3000:]
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env, check=True, timeout=30)
    cancelled_at = time.monotonic()
    while not (state := cluster.final_state(job_id)):
        assert time.monotonic() - cancelled_at < 90, "the cancelled job did not end"
        time.sleep(0.5)
    assert state == "CANCELLED", state
    _nothing_left(cluster, tag)
    log = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert "SIGTERM" in log, log[-3000:]
    shutil.rmtree(f"/tmp/slimrl-ray-{job_id}", ignore_errors=True)  # kept for debugging
    checkpoint = run_dir / "checkpoints" / latest.read_text().strip()
    resumed_from = int(re.search(r"(\d+)$", checkpoint.name).group(1))  # type: ignore[union-attr]
    assert resumed_from >= 2 and (checkpoint / "metadata.json").exists(), list(checkpoint.iterdir())
    # Both trainer ranks (one per node, below) wrote their share into the shared run directory.
    written = {p.name for p in checkpoint.iterdir()}
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= written, written
    assert {n.split("_")[2] for n in written if n.endswith(".distcp")} == {"0", "1"}, written

    # 2. Resubmitted: resumes there and completes; an EP2 trainer over the first two nodes (its
    # rendezvous and gloo groups cross the link), the engine on the third.
    tag = new_tag()
    steps = resumed_from + STEPS_AFTER_RESUME
    env = job_env(cluster, _overrides(tiny_model, mod_sum_data, tmp_path, steps, 1, ep=2), tag)
    with HostWatcher(list(cluster.nodes)) as watch:
        job = submit_and_wait(cluster, env, args(tag), tmp_path)
    assert job.returncode == 0 and cluster.final_state(job.job_id) == "COMPLETED", (
        job.stderr,
        job.log[-5000:],
    )
    assert _head(job.log) == head_node and "Ray: 3 node(s)" in job.log
    assert f"(step {resumed_from})" in job.log and "resumed from" in job.log, job.log[-3000:]
    head_ip, engine_ip = cluster.nodes[head_node], cluster.nodes[engine_node]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["ray"]["address"] == f"{head_ip}:{RAY_PORT}"
    assert saved["cluster"]["num_nodes"] == 3 and saved["cluster"]["device"] == "cpu"
    resolved = yaml.safe_load((run_dir / "resolved.yaml").read_text())
    assert resolved["rollout"]["weight_sync"] == "distributed" and resolved["parallel"]["ep"] == 2

    # Where things ran: each host is a network namespace, so this is the host a process was on.
    trainers = {
        n for n, cmds in watch.processes.items() if any(c.startswith("ray::_ActorHost") for c in cmds)
    }
    engines = {
        n for n, cmds in watch.processes.items() if any(c.startswith("ray::EngineActor") for c in cmds)
    }
    servers = {
        n for n, cmds in watch.processes.items() if any(" serve " in c and "slimrl" in c for c in cmds)
    }
    assert trainers == {head_node, second_node} and engines == servers == {engine_node}, watch.processes
    # Rank 1 (second node) talked to the head across the link outside Ray's ports (the GCS and the
    # core workers' gRPC range): the trainers' TCP store and gloo pairs.
    torch_links = [
        c for c in watch.connections
        if c.node == second_node and c.comm.startswith("ray::_Act") and c.peer.startswith(f"{head_ip}:")
        and int(c.peer.rsplit(":", 1)[1]) not in (RAY_PORT, *RAY_WORKER_PORTS)
    ]  # fmt: skip
    assert torch_links, sorted(c for c in watch.connections if c.node == second_node)
    engine_log = (run_dir / "logs" / "engine0.log").read_text()
    assert f"ready at http://{engine_ip}:" in engine_log
    # Every weight update crossed the link: asked for from the head, received by the engine node.
    updates = re.findall(
        rf'{re.escape(head_ip)} - "POST /update_weights_from_distributed HTTP/1.1" 200', engine_log
    )
    assert len(updates) >= steps, len(updates)

    # Addresses: every socket the run listened on is on its host's address or loopback, except
    # Ray's own servers (exposed() spells out which).
    assert watch.listeners, "no socket seen"
    for listener in watch.listeners:
        ip = cluster.nodes[listener.node]
        assert listener.host in (ip, "*") or listener.host.startswith("127."), listener
    assert not [entry for entry in watch.listeners if exposed(entry)]
    engine_listens = {
        (s.host, s.comm) for s in watch.listeners if s.node == engine_node and s.host == engine_ip
    }
    assert engine_listens, watch.listeners

    # A learning run: metrics of every step since the resume, an update that changed the policy,
    # and the engine serving the updated weights at the next step (its logprobs equal the trainer's).
    rows = metrics(run_dir)[-STEPS_AFTER_RESUME:]
    assert [r["step"] for r in rows] == list(range(resumed_from + 1, steps + 1)), rows
    for row in rows:
        for key in ("rollout/raw_reward", "train/pg_loss", "train/grad_norm", "perf/weight_sync_seconds"):
            assert isinstance(row.get(key), float), (key, row)
    updated = [i for i, r in enumerate(rows[:-1]) if r["train/grad_norm"] > 0]
    assert updated, rows
    for i in updated:
        assert rows[i + 1]["train/train_rollout_logprob_abs_diff_max"] < 1e-5, rows[i + 1]
    # Checkpoints of the resumed run, the last one at the end.
    assert (run_dir / "checkpoints" / "latest").read_text().strip().endswith(f"{steps:07d}")
    assert not Path(f"/tmp/slimrl-ray-{job.job_id}").exists()  # every node's Ray dir, after a good run
    _nothing_left(cluster, tag)
    print(f"3-node job {job.job_id}: {job.seconds:.0f} s, resumed at step {resumed_from}")


def test_grpo_on_one_node(cluster, tmp_path, tiny_model, mod_sum_data):
    """One trainer rank and one engine on one node (head on 127.0.0.2)."""
    tag = new_tag()
    steps = STEPS_AFTER_RESUME
    env = job_env(cluster, _overrides(tiny_model, mod_sum_data, tmp_path, steps, 2), tag)
    job = submit_and_wait(cluster, env, sbatch_args(cluster, 1, 2, tmp_path, f"slimrl-1n-{tag}"), tmp_path)
    assert job.returncode == 0 and cluster.final_state(job.job_id) == "COMPLETED", (
        job.stderr,
        job.log[-5000:],
    )
    run_dir = tmp_path / "grpo"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    for row in rows:
        for key in ("rollout/raw_reward", "train/pg_loss"):
            assert isinstance(row.get(key), float), (key, row)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["ray"]["address"] == f"127.0.0.2:{RAY_PORT}"
    assert saved["cluster"]["device"] == "cpu" and saved["cluster"]["num_nodes"] == 1
    assert "Ray: 1 node(s)" in job.log
    _nothing_left(cluster, tag)
    assert not Path(f"/tmp/slimrl-ray-{job.job_id}").exists()  # removed after a successful run
    print(f"1-node job {job.job_id}: {job.seconds:.0f} s")


@pytest.mark.sglang  # its engine is real SGLang
def test_engine_node_dies_mid_run(cluster, tmp_path, tiny_model, mod_sum_data):
    """Every process of the engine's node is killed mid-run, slurmd included (as when the host
    goes down): the run stops within a bound with one line that names the engine, its node and
    the checkpoint to resume from; nothing is left on the other node. Last in the module: the
    node stays down."""
    head, engine_node = list(cluster.nodes)[:2]
    tag = new_tag()
    overrides = [*_overrides(tiny_model, mod_sum_data, tmp_path, 200, 1), "rollout.engine=sglang"]
    env = job_env(cluster, overrides, tag)
    args = [*sbatch_args(cluster, 2, 1, tmp_path, f"slimrl-die-{tag}"), f"--nodelist={head},{engine_node}"]
    job_id = submit(env, args)
    run_dir = tmp_path / "grpo"
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 2):
        assert time.monotonic() < deadline and not cluster.final_state(job_id)
        time.sleep(0.5)
    # Real SGLang on the other node took every update over the link: its logprobs are the trainer's.
    head_ip, engine_ip = cluster.nodes[head], cluster.nodes[engine_node]
    assert_sglang_log(run_dir / "logs" / "engine0.log")
    engine_log = (run_dir / "logs" / "engine0.log").read_text(errors="replace")
    updates = re.findall(
        rf'{re.escape(head_ip)}:\d+ - "POST /update_weights_from_distributed HTTP/1.1" 200', engine_log
    )
    synced = metrics(run_dir)
    assert len(updates) >= len(synced) >= 2, engine_log[-3000:]
    assert all(r["train/train_rollout_logprob_abs_diff_max"] < 1e-5 for r in synced), synced
    killed = [pid for pid in netns_pids(engine_node) if comm(pid) != "?"]
    assert any(comm(pid) == "slurmd" for pid in killed)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while not (state := cluster.final_state(job_id)):
        assert time.monotonic() - killed_at < 120, "the job did not end after its engine node died"
        time.sleep(0.5)
    stopped_s = time.monotonic() - killed_at
    log = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert state == "FAILED", (state, log[-3000:])
    errors = [line for line in log.splitlines() if line.startswith("slimrl: error:")]
    assert len(errors) == 1, log[-5000:]
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert re.fullmatch(
        rf"slimrl: error: engine 0 \(http://{re.escape(engine_ip)}:\d+\) is lost with its node "
        rf"{engine_node} \({re.escape(engine_ip)}\): its Ray actor is gone; the run stopped in step "
        rf"\d+: resubmit to resume from {re.escape(str(latest))}",
        errors[0],
    ), errors[0]
    # The rollout stopped at the first request that found no engine, not sample by sample.
    assert len(re.findall(r"sample \d+ failed", log)) <= 64, log[-3000:]
    _nothing_left(cluster, tag)
    print(f"engine node killed: job ended {stopped_s:.0f} s later; {errors[0]}")
