"""Inference server processes: start, health-check, restart, stop.

The same lifecycle serves real SGLang servers (GPU) and the embedded engine (`slimrl serve`, CPU);
only the command line differs. Every process we start, we stop: servers run in their own process
group and are terminated (then killed) as a group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError

logger = logging.getLogger(__name__)


@dataclass
class ServerProcess:
    """One inference server: its command, address and (once started) process."""

    name: str
    command: list[str]
    host: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    api_key: str | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        log = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command,
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() takes its children too
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode if self.process else None
                raise SlimError(f"{self.name} exited with code {code} while starting ({self.log_hint()})")
            if self.healthy():
                return
            time.sleep(0.2)
        raise SlimError(f"{self.name} not healthy after {timeout:.0f} s at {self.url} ({self.log_hint()})")

    def log_hint(self) -> str:
        return f"log: {self.log_path}" if self.log_path else "no log file"

    def stop(self, grace: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=grace)
        else:
            _signal_group(self.process.pid, signal.SIGKILL)  # stray children of a dead server
        self.process = None

    def kill(self) -> None:
        """Simulate (or force) a crash: SIGKILL the whole group without waiting politely."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def restart(self, timeout: float) -> None:
        self.stop()
        self.restarts += 1
        self.start()
        self.wait_healthy(timeout)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def embedded_command(config: SlimConfig, model_path: str, host: str, port: int, index: int) -> list[str]:
    """`slimrl serve` for the CPU fleet: same HTTP API as SGLang."""
    cmd = [
        sys.executable,
        "-m",
        "slimrl.cli",
        "serve",
        "--model",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
    ]
    cmd += ["--seed", str(config.run.seed + index)]
    if config.rollout.api_key:
        cmd += ["--api-key", config.rollout.api_key]
    if config.algorithm.true_on_policy:
        cmd += ["--true-on-policy"]
    return cmd


def server_command(
    config: SlimConfig, model_path: str, host: str, port: int, index: int
) -> tuple[list[str], dict]:
    """The command (and extra environment) that starts engine `index` of the fleet."""
    if config.rollout.engine == "embedded":
        return embedded_command(config, model_path, host, port, index), {"OMP_NUM_THREADS": "1"}
    from slimrl.rollout.sglang.server_args import build_launch_command, sglang_env

    base_gpu = index * config.rollout.gpus_per_engine % max(config.cluster.gpus_per_node, 1)
    cmd = build_launch_command(
        config, model_path=model_path, host=host, port=port, engine_index=index, base_gpu_id=base_gpu
    )
    return cmd, sglang_env(config)
