"""Inference server processes: start, health-check, restart, stop.

The same lifecycle serves real SGLang servers (GPU) and the embedded engine (`slimrl serve`, CPU);
only the command line differs. Every process we start, we stop: servers run in their own process
group and are terminated (then killed) as a group, and on Linux the kernel terminates them if the
process that started them dies without stopping them (even by SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from slimrl.compat.sglang_cpu import check_sglang_version
from slimrl.config.schema import SlimConfig
from slimrl.devices.device import resolve_device
from slimrl.errors import SlimError
from slimrl.rollout.sglang.server_args import build_launch_command, sglang_env
from slimrl.utils.net import free_port

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
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                self.command,
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() takes its children too
                preexec_fn=_die_with_parent_hook(),
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # the child has its own copy
        logger.debug("%s started: pid %d, %s", self.name, self.process.pid, self.url)

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
        """SIGTERM the group, SIGKILL it after `grace` s; then kill what is left of the group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, grace)
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=grace)
        _signal_group(self.process.pid, signal.SIGKILL)  # stray children of the server, if any
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
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


_PR_SET_PDEATHSIG = 1


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the kernel SIGTERM the server when we die, even by SIGKILL.

    Linux only, and only from the main thread: the signal fires when the *thread* that forked
    exits, so a server started from a short-lived worker thread would die with that thread.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return hook


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
    if config.rollout.admin_api_key:
        cmd += ["--admin-api-key", config.rollout.admin_api_key]
    if config.algorithm.true_on_policy:
        cmd += ["--true-on-policy"]
    if config.rollout.sglang.weights_cpu_backup:  # the same memory-release contract as SGLang's
        cmd += ["--enable-weights-cpu-backup"]
    if config.model.trust_remote_code:
        cmd += ["--trust-remote-code"]
    return cmd


def server_command(
    config: SlimConfig, model_path: str, host: str, port: int, index: int, base_gpu_id: int | None = None
) -> tuple[list[str], dict]:
    """The command (and extra environment) that starts engine `index` of the fleet.

    `base_gpu_id` is the CUDA ordinal of the engine's first GPU as its process sees it (the Ray
    fleet passes the one its placement-group slots give, see `devices/launch_plan.py`);
    None takes it from the config's own layout, for fleets started outside Ray.
    """
    if config.rollout.engine == "embedded":
        return embedded_command(config, model_path, host, port, index), {"OMP_NUM_THREADS": "1"}

    check_sglang_version()
    on_cpu = resolve_device(config) == "cpu"
    base_gpu = config.base_gpu_id(index) if base_gpu_id is None else base_gpu_id
    cmd = build_launch_command(
        config, model_path=model_path, host=host, port=port, engine_index=index, base_gpu_id=base_gpu,
        on_cpu=on_cpu,
    )  # fmt: skip
    return cmd, sglang_env(config, on_cpu)


def start_server(
    config: SlimConfig, model_path: str, log_path: Path, index: int = 0, timeout: float = 600.0
) -> ServerProcess:
    """Engine `index` of `config` on a free local port, started as a run starts it and healthy;
    if it does not come up it is stopped and the error carries the tail of its log."""

    port = free_port()
    cmd, env = server_command(config, model_path, "127.0.0.1", port, index)
    server = ServerProcess(log_path.stem, cmd, "127.0.0.1", port, env=env, log_path=log_path,
                           api_key=config.rollout.api_key)  # fmt: skip
    server.start()
    try:
        server.wait_healthy(timeout)
    except SlimError as exc:
        server.stop()
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        raise SlimError(f"{exc}\n{tail}") from None
    return server
