"""`sbatch slurm/grpo_moe_256gpu.sh` on a real one-node Slurm cluster (Debian's packages).

slurm/local/start_cluster.sh installs (first time only, ~30 s), configures and starts munged,
slurmctld and slurmd; the 32-node script is then submitted with the command-line overrides that
fit one CPU node. Inside the job, srun starts a Ray head and `slimrl train` joins it through
`ray.address` and runs GRPO on the tiny MoE (two training ranks, two embedded engines). The test
checks the job's final state, the run's metrics, that nothing the job started is still running,
and stops the daemons it started (see docs/slurm.md).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

# No `from tests.conftest import ...`: that only resolves under `python -m pytest`, and this file
# should also run as `.venv/bin/pytest tests/test_slurm.py`.
REPO = Path(__file__).resolve().parent.parent

LOCAL = REPO / "slurm" / "local"
SCRIPT = REPO / "slurm" / "grpo_moe_256gpu.sh"
RUN_DIR = Path(os.environ.get("SLIMRL_SLURM_RUN_DIR", "/run/slimrl-local-slurm"))
STEPS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _starttime(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after "pid (comm)"


def _recorded_daemons() -> dict[str, tuple[int, str]]:
    """Daemons start_cluster.sh recorded as started by itself and still running: name -> (pid, start)."""
    alive = {}
    for rec in RUN_DIR.glob("*.rec"):
        pid, start, *_ = rec.read_text().split()
        if _starttime(int(pid)) == start:
            alive[rec.stem] = (int(pid), start)
    return alive


@pytest.fixture(scope="module")
def slurm_partition():
    """A running local cluster; stopped afterwards unless it was already running before."""
    already_up = _recorded_daemons()
    started: dict[str, tuple[int, str]] = {}
    try:
        proc = subprocess.run([str(LOCAL / "start_cluster.sh")], capture_output=True, text=True, timeout=900)
        started = {k: v for k, v in _recorded_daemons().items() if k not in already_up}
        if proc.returncode == 3:
            pytest.skip(f"no local Slurm cluster here: {proc.stderr.strip().splitlines()[-1]}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield proc.stdout.split()[-1]
    finally:
        if started:
            stop = subprocess.run(
                [str(LOCAL / "stop_cluster.sh")], capture_output=True, text=True, timeout=120
            )
            assert stop.returncode == 0, stop.stderr[-3000:]
            left = {name: pid for name, (pid, start) in started.items() if _starttime(pid) == start}
            assert not left, f"daemons still running after stop_cluster.sh: {left}\n{stop.stderr}"


def _job_processes(tag: str) -> list[str]:
    """Processes that inherited the job's environment (ray start, raylet, workers, slimrl)."""
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


def test_sbatch_script_runs_grpo_on_one_cpu_node(slurm_partition, tmp_path, tiny_model, mod_sum_data):
    tag = uuid.uuid4().hex[:12]
    job_name = f"slimrl-test-{tag}"
    log_pattern = tmp_path / "slurm-%j.out"
    overrides = [
        f"model.hf_checkpoint={tiny_model('qwen3_moe')}",
        f"data.prompt_data={mod_sum_data}",
        f"run.runs_dir={tmp_path}",
        "run.name=slurm",
        f"train.num_steps={STEPS}",
        "rollout.rollout_batch_size=16",
        "rollout.n_samples_per_prompt=8",
    ]
    env = dict(os.environ)
    env.update(
        SLIMRL_CONFIG="configs/tiny_moe_grpo_cpu.yaml",
        SLIMRL_OVERRIDES=" ".join(overrides),
        # Any port but 6379: other Ray clusters may run on this machine.
        SLIMRL_RAY_PORT=str(_free_port()),
        # sbatch hands the environment to the job: every process it starts carries this tag.
        SLIMRL_TEST_TAG=tag,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    if sys.prefix != sys.base_prefix:
        env["SLIMRL_VENV"] = sys.prefix
    # The script asks for 32 nodes x 8 GPUs; these are the overrides that fit one CPU node.
    cmd = [
        str(LOCAL / "sbatch_wait.sh"),
        "--nodes=1",
        "--gpus-per-node=0",
        "--cpus-per-task=2",
        "--mem=0",
        f"--partition={slurm_partition}",
        "--time=10",
        f"--job-name={job_name}",
        f"--output={log_pattern}",
        str(SCRIPT),
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=720)
    finally:
        # Only reached with a job left when the wait itself timed out.
        subprocess.run(["scancel", f"--name={job_name}"], capture_output=True, timeout=30)
    elapsed = time.monotonic() - start
    job_logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, f"{proc.stderr}\n--- job output ---\n{job_logs[-5000:]}"
    job_id = proc.stdout.split()[-1]

    # The final state, as slurmctld recorded it when the job ended (not what sbatch returned).
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    pairs = (line.split("=", 1) for line in config.splitlines() if " = " in line)
    jobcomp = {key.strip(): value.strip() for key, value in pairs}["JobCompLoc"]
    record = [line for line in Path(jobcomp).read_text().splitlines() if line.startswith(f"JobId={job_id} ")]
    assert record and "JobState=COMPLETED" in record[-1], record

    # slimrl trained, on CPU, inside the Ray cluster the job started (not a local one of its own).
    run_dir = tmp_path / "slurm"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    for row in rows:
        for key in ("rollout/raw_reward", "train/pg_loss"):
            assert isinstance(row.get(key), float), (key, row)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["ray"]["address"] == f"127.0.0.2:{env['SLIMRL_RAY_PORT']}"
    assert saved["cluster"]["device"] == "cpu" and saved["cluster"]["num_nodes"] == 1
    assert "Ray: 1 node(s)" in job_logs

    # Nothing the job started outlives it: Ray's processes ended with its srun step.
    deadline = time.monotonic() + 15
    while (left := _job_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
    assert not Path(f"/tmp/slimrl-ray-{job_id}").exists()  # removed after a successful run
    print(f"job {job_id} completed in {elapsed:.0f} s")
