"""Shared fixtures: tiny local assets (nothing is downloaded) and a torchrun launcher."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slimrl.utils import net
from tests import suite_clock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SUITE_CLOCK = pytest.StashKey[tuple[str, float, float]]()


SGLANG_TIER_MODULES = {
    "test_sglang_real", "test_weight_wire", "test_sglang_parser", "test_rl_sglang", "test_transport_matrix",
    "test_sglang_loaders", "test_engine_plan_sglang", "test_update_check",
    "test_fp8_rollout",
}  # fmt: skip


NETWORK_HOST_MODULES = {"test_slurm_multinode", "test_transport_matrix", "test_agent_remote"}
"""Modules that build network-namespace hosts: under `-n 2` they take turns (`network_hosts`)."""

MODULE_SECONDS = {
    "test_rl_sglang": 547,
    "test_slurm_multinode": 451,
    "test_demo": 314,
    "test_rl_e2e": 311,
    "test_convert": 278,
    "test_transport_matrix": 199,
    "test_agent_endpoint": 205,
    "test_ppo": 150,
    "test_engine_contract": 131,
    "test_rl_trainer": 130,
    "test_memory_plan": 104,
    "test_routing_replay": 99,
    "test_megatron_layouts": 95,
    "test_install": 64,
    "test_golden_trajectory": 52,
    "test_true_on_policy": 48,
    "test_export": 47,
    "test_resume": 45,
    "test_weight_sync": 44,
    "test_rollout": 38,
    "test_launch_plan": 37,
    "test_fleet": 36,
    "test_gpu_configs": 34,
    "test_rollout_cli": 23,
    "test_engine_plan_sglang": 22,
    "test_sglang_loaders": 21,
    "test_sft_e2e": 20,
    "test_sft_conversations": 35,
    "test_agent_learning": 200,
    "test_config": 13,
    "test_weight_sync_order": 11,
    "test_weight_wire": 9,
    "test_weight_sync_hang": 9,
    "test_package_deps": 8,
    "test_embedded_server": 7,
    "test_trainer_plumbing": 6,
    "test_hostile_inputs": 6,
    "test_step_time": 5,
    "test_checkpoint_dir": 4,
    "test_sglang_parser": 3,
    "test_ledger": 2,
    "test_embedded_engine": 1,
    "test_tokenizer": 1,
    "test_fp8_rollout": 1,
    "test_rewards": 1,
    "test_tiny_models": 1,
}
"""Each module's time in the suite's own run (2 cores, two workers, `--durations=0`, a clean clone
of session 23, 1762 s of tests, nothing else running): under `-n 2 --dist
loadfile` (each module one unit of work, so its module fixtures start once) the heaviest modules
start first, so the two workers end together. A module not listed counts as quick."""


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # xdist workers have it


def pytest_sessionstart(session: pytest.Session) -> None:
    """A whole tier's run times a fixed workload first (`suite_clock.py`): its time is then gated
    in those units by `make bench`."""
    config = session.config
    option = config.option
    narrowed = bool(option.collectonly or getattr(option, "lf", False) or option.deselect)
    tier = suite_clock.tier_of(config.args, option.markexpr or "", option.keyword or "", narrowed)
    if _controller(config) and tier is not None:
        config.stash[SUITE_CLOCK] = (tier, suite_clock.calibrate(), time.monotonic())


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    clock = config.stash.get(SUITE_CLOCK, None)
    passed = len(terminalreporter.stats.get("passed", []))
    if clock is None or exitstatus != 0 or passed == 0:
        return
    tier, first_s, start = clock
    seconds = time.monotonic() - start
    # Again at the end, keeping the faster: one sample can fall in a busy moment (a previous run's
    # servers still shutting down), and a busy calibration reads as a fast suite.
    calibration_s = min(first_s, suite_clock.calibrate())
    workers = getattr(config.option, "numprocesses", None) or 1
    entry = suite_clock.row(tier, seconds, calibration_s, passed, int(workers))
    suite_clock.append(suite_clock.SUITE_TIMES, entry)
    terminalreporter.write_line(
        f"suite time: tier {tier}, {entry['seconds']:.0f} s = {entry['units']:.0f} calibrations of "
        f"{calibration_s:.3f} s ({suite_clock.SUITE_TIMES.relative_to(REPO)}; "
        "`make bench` compares it with bench/baseline.json)"
    )


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the real-SGLang tier (`pytest -m sglang` runs it alone): its modules, and every test
    parametrised with the `sglang` engine."""
    callspec = getattr(item, "callspec", None)
    if _module(item) in SGLANG_TIER_MODULES or (callspec and "sglang" in callspec.params.values()):
        item.add_marker(pytest.mark.sglang)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest modules first, so the two workers end together."""
    first_seen = {module: index for index, module in reversed(list(enumerate(map(_module, items))))}
    items.sort(key=lambda item: (-MODULE_SECONDS.get(_module(item), 0.0), first_seen[_module(item)]))


def _module(item: pytest.Item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""


@pytest.fixture(scope="module", autouse=True)
def network_hosts(request) -> Iterator[None]:
    """The network-host modules take turns across xdist workers: hosts, bridges and the Slurm
    cluster's ports are the machine's, whoever asks."""
    if _module(request.node) not in NETWORK_HOST_MODULES:
        yield
        return
    with open(Path(tempfile.gettempdir()) / "slimrl-network-hosts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def tiny_model(assets) -> Callable[..., Path]:
    """tiny_model("qwen3_moe", num_experts=3) -> a cached HF checkpoint directory."""
    from slimrl.data.tiny_models import make_tiny

    def make(arch: str, seed: int = 0, **overrides) -> Path:
        suffix = "_".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        out = assets / f"{arch}_s{seed}_{suffix}".rstrip("_")
        if not out.exists():
            make_tiny(arch, out, seed=seed, overrides=overrides or None)
        return out

    return make


@pytest.fixture(scope="session")
def mod_sum_data(assets) -> Path:
    from slimrl.data.toy_tasks import make_data

    out = assets / "mod_sum.jsonl"
    if not out.exists():
        make_data("mod_sum", out, num_samples=512, seed=0)
    return out


def free_port() -> int:
    return net.free_port()


def run_torchrun(
    script: Path, nproc: int, args: list[str], out_dir: Path, timeout: float = 300
) -> list[dict]:
    """Run a worker under torchrun; each rank writes out_dir/rank<k>.json. Returns them by rank."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        port = free_port()
        cmd = [
            PYTHON, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
            str(script), str(out_dir), *args,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        # Under two pytest workers the port `free_port` saw free can be taken before torchrun's store
        # binds it (EADDRINUSE at rendezvous, before any rank ran): another port, not a failure.
        if not (proc.returncode != 0 and "EADDRINUSE" in proc.stderr and "rendezvous" in proc.stderr):
            break
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{tail}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_slimrl(*args: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "slimrl.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO
    )
