"""The multi-host Slurm test cluster (slurm/local/start_multinode.sh) as Python sees it: start and
stop it, submit `slurm/grpo_moe_256gpu.sh`, and watch what runs and listens on each host.

Shared by tests/test_slurm_multinode.py and bench/bench_slurm_multinode.py. Every host is a network
namespace named after its node, so `ip netns pids <node>` lists exactly the processes on that node
and `ip netns exec <node> ss` its sockets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCAL = REPO / "slurm" / "local"
SCRIPT = REPO / "slurm" / "grpo_moe_256gpu.sh"
SLURM_DAEMONS = {"slurmd", "slurmctld", "slurmscriptd"}
# Ray's core workers (drivers and actors) serve gRPC on a port from this range (Ray's default
# --min-worker-port/--max-worker-port), on every address.
RAY_WORKER_PORTS = range(10002, 20000)
RAY_AUTOSCALER_METRICS_PORT = 44217


class ClusterUnavailable(Exception):
    """start_multinode.sh exited 3: no root or no Slurm here."""


@dataclass
class Cluster:
    conf: str
    partition: str
    nodes: dict[str, str]
    """node name -> cluster address, in host order"""

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": self.conf}

    def scontrol(self, *args: str) -> str:
        env = {**os.environ, **self.env}
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, env=env, timeout=30).stdout

    def final_state(self, job_id: str) -> str:
        """The job's final state from the jobcomp log ('' while it has none)."""
        config = dict(
            (k.strip(), v.strip())
            for k, v in (
                line.split("=", 1) for line in self.scontrol("show", "config").splitlines() if " = " in line
            )
        )
        log = Path(config["JobCompLoc"])
        lines = (
            [line for line in log.read_text().splitlines() if line.startswith(f"JobId={job_id} ")]
            if log.exists()
            else []
        )
        match = re.search(r"JobState=(\w+)", lines[-1]) if lines else None
        return match.group(1) if match else ""


@contextmanager
def multinode_cluster(hosts: int = 2) -> Iterator[Cluster]:
    """A running cluster of `hosts` hosts; everything it made is gone afterwards."""
    start = subprocess.run(
        [str(LOCAL / "start_multinode.sh"), "--hosts", str(hosts)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    try:
        if start.returncode == 3:
            raise ClusterUnavailable(start.stderr.strip().splitlines()[-1])
        if start.returncode != 0:
            raise RuntimeError(f"start_multinode.sh failed ({start.returncode}):\n{start.stderr[-3000:]}")
        info = dict(line.split("=", 1) for line in start.stdout.splitlines() if "=" in line)
        nodes = dict(item.split(":") for item in info["NODES"].split(","))
        yield Cluster(conf=info["SLURM_CONF"], partition=info["PARTITION"], nodes=nodes)
    finally:
        if start.returncode != 3:
            stop = subprocess.run(
                [str(LOCAL / "stop_multinode.sh")], capture_output=True, text=True, timeout=180
            )
            if stop.returncode != 0:
                raise RuntimeError(f"stop_multinode.sh failed:\n{stop.stderr[-3000:]}")


def netns_pids(node: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, timeout=10).stdout
    return [int(p) for p in out.split()]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def job_processes(node: str) -> list[str]:
    """Processes on `node` other than the Slurm daemons: what a job left behind."""
    return [
        f"{p} {comm(p)}: {cmdline(p)[:120]}" for p in netns_pids(node) if comm(p) not in SLURM_DAEMONS | {"?"}
    ]


def _loads_ray_core(pid: int) -> bool | None:
    """None when the process is gone or going: exited since `ss` listed it, or exiting (the kernel
    releases its memory map before its files, so for a moment its sockets outlive an empty map and
    an empty command line: seen once in a clean clone as a Ray worker with neither)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    return ("_raylet.so" in maps) if maps else None


@dataclass(frozen=True)
class Listener:
    node: str
    host: str
    """'*' for every address"""
    port: int
    comm: str
    cmdline: str
    ray_core: bool
    """the process hosts Ray's core (a raylet, the GCS, or a Ray driver/worker)"""


@dataclass(frozen=True)
class Connection:
    node: str
    local: str
    peer: str
    comm: str


_SS_USER = re.compile(r'\("([^"]*)",pid=(\d+),')


def _split_address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    host = host.strip("[]").removeprefix("::ffff:")
    return ("*" if host in ("*", "0.0.0.0", "::") else host), int(port)


@dataclass
class HostWatcher:
    """Polls every host's listening sockets, connections and processes while a job runs."""

    nodes: list[str]
    interval_s: float = 0.2
    listeners: set[Listener] = field(default_factory=set)
    connections: set[Connection] = field(default_factory=set)
    processes: dict[str, set[str]] = field(default_factory=dict)
    """node -> every `cmdline` seen there"""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HostWatcher:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            for node in self.nodes:
                self._sample(node)
            self._stop.wait(self.interval_s)

    def _sample(self, node: str) -> None:
        seen = self.processes.setdefault(node, set())
        for pid in netns_pids(node):
            seen.add(cmdline(pid))
        for flags in ("-ltnpH", "-tnpH"):  # listening; established
            out = subprocess.run(
                ["ip", "netns", "exec", node, "ss", flags], capture_output=True, text=True, timeout=10
            )
            for line in out.stdout.splitlines():
                parts, users = line.split(), _SS_USER.findall(line)
                if len(parts) < 5 or not users:
                    continue
                state, local, peer = parts[0], parts[3], parts[4]
                name, pid = users[0][0], int(users[0][1])
                if state == "LISTEN":
                    host, port = _split_address(local)
                    command, ray_core = cmdline(pid)[:160], _loads_ray_core(pid)
                    if ray_core is None:  # gone or going: the samples before saw it alive
                        continue
                    self.listeners.add(Listener(node, host, port, name, command, ray_core))
                elif state == "ESTAB":
                    self.connections.add(Connection(node, local, peer, name))


def exposed(listener: Listener) -> bool:
    """A socket that listens on every address and is not one of Ray's (docs/slurm.md: Ray 2.60
    binds its GCS, raylet and core-worker gRPC servers and the autoscaler's metrics exporter to every
    address; the gRPC ones need the job's token)."""
    if listener.host != "*":
        return False
    if listener.comm in ("gcs_server", "raylet"):
        return False
    if listener.port == RAY_AUTOSCALER_METRICS_PORT and "monitor.py" in listener.cmdline:
        return False
    return not (listener.port in RAY_WORKER_PORTS and listener.ray_core)


@dataclass
class Submission:
    job_id: str
    returncode: int
    log: str
    stderr: str
    seconds: float


def job_env(cluster: Cluster, overrides: list[str], tag: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(cluster.env)
    env.update(
        SLIMRL_CONFIG="configs/tiny_moe_grpo_cpu.yaml",
        SLIMRL_OVERRIDES=" ".join(overrides),
        # sbatch hands the environment to the job: every process it starts carries this tag.
        SLIMRL_TEST_TAG=tag,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    if sys.prefix != sys.base_prefix:
        env["SLIMRL_VENV"] = sys.prefix
    env.update(extra)
    return env


def grpo_overrides(
    model: Path, data: Path, runs: Path, name: str, steps: int, slots_per_node: int
) -> list[str]:
    """GRPO on the tiny MoE with one trainer rank and one engine on separate slots."""
    return [
        f"model.hf_checkpoint={model}",
        f"data.prompt_data={data}",
        f"run.runs_dir={runs}",
        f"run.name={name}",
        f"train.num_steps={steps}",
        "rollout.rollout_batch_size=32",
        "rollout.n_samples_per_prompt=16",
        f"cluster.gpus_per_node={slots_per_node}",
        "cluster.colocate=false",
        "cluster.rollout_gpus=1",
        "rollout.num_engines=1",
        "parallel.ep=1",
    ]


def sbatch_args(cluster: Cluster, nodes: int, cpus: int, out_dir: Path, name: str) -> list[str]:
    """The overrides of the script's 32-node x 8-GPU request that fit the test cluster."""
    return [
        f"--nodes={nodes}",
        "--gpus-per-node=0",
        f"--cpus-per-task={cpus}",
        "--mem=0",
        f"--partition={cluster.partition}",
        "--time=10",
        f"--job-name={name}",
        f"--output={out_dir}/slurm-%j.out",
    ]


def submit_and_wait(
    cluster: Cluster, env: dict[str, str], args: list[str], out_dir: Path, timeout_s: float = 600
) -> Submission:
    """sbatch_wait.sh: returns when the job has ended (returncode 0 only for COMPLETED)."""
    start = time.monotonic()
    name = next(a.split("=", 1)[1] for a in args if a.startswith("--job-name="))
    try:
        proc = subprocess.run(
            [str(LOCAL / "sbatch_wait.sh"), *args, str(SCRIPT)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
    finally:
        subprocess.run(["scancel", f"--name={name}"], env=env, capture_output=True, timeout=30)
    job_id = proc.stdout.split()[-1] if proc.stdout.split() else ""
    log = out_dir / f"slurm-{job_id}.out"
    text = log.read_text(errors="replace") if job_id and log.exists() else ""
    return Submission(job_id, proc.returncode, text, proc.stderr, time.monotonic() - start)


def submit(env: dict[str, str], args: list[str]) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", *args, str(SCRIPT)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def new_tag() -> str:
    return uuid.uuid4().hex[:12]


def tagged_processes(tag: str) -> list[str]:
    """Processes anywhere on the machine that inherited a job's environment (its SLIMRL_TEST_TAG)."""
    found = []
    needle = f"SLIMRL_TEST_TAG={tag}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:200]!r}")
        except OSError:
            continue
    return found
