"""One inference server we own: its process, its health, its restart on a fresh port.

The same object serves both drivers: `slimrl rollout` holds its engines in-process
(`rollout/fleet.py`), `slimrl train` runs each one as a Ray actor on its node
(`orchestration/rollout_manager.py`, which only says where it listens and which GPU it starts at).
"""

from __future__ import annotations

import threading
from pathlib import Path

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError
from slimrl.rollout.servers import ServerProcess, server_command
from slimrl.utils.net import free_port

LOCALHOST = "127.0.0.1"


class EngineProcess:
    def __init__(
        self, config: SlimConfig, index: int, log_dir: str | Path, model_path: str | None = None
    ) -> None:
        self.config, self.index, self.log_dir = config, index, Path(log_dir)
        self.model_path = str(model_path or config.model.hf_checkpoint)
        """What the server loads: the HF checkpoint, or its block-FP8 copy for an FP8 fleet."""
        self.server: ServerProcess | None = None
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopped = False

    def host(self) -> str:
        """The address the server listens on (and the fleet reaches it at)."""
        return LOCALHOST

    def base_gpu_id(self) -> int | None:
        """CUDA ordinal of the server's first GPU as its process sees it; None on CPU."""
        return None

    @property
    def url(self) -> str:
        if self.server is None:
            raise SlimError(f"engine{self.index} has no server")
        return self.server.url

    def spawn(self) -> None:
        """Start the server on a fresh port without waiting for it, replacing one that died (its
        port may linger in TIME_WAIT, and a request still held for the old address must fail
        rather than reach a different server). Refused once stopped: a restart that races the
        fleet's shutdown starts nothing the shutdown would miss."""
        host, port = self.host(), free_port()
        cmd, env = server_command(self.config, self.model_path, host, port, self.index, self.base_gpu_id())
        with self._lock:
            if self._stopped:
                raise SlimError(f"engine{self.index} was stopped")
            if self.server is not None:
                self.server.stop()
            self.server = ServerProcess(
                name=f"engine{self.index}", command=cmd, host=host, port=port, env=env,
                log_path=self.log_dir / f"engine{self.index}.log", api_key=self.config.rollout.api_key,
                restarts=self.restarts,
            )  # fmt: skip
            self.server.start()

    def wait(self) -> str:
        """Wait until the server answers; its pid goes to `<log_dir>/engine<i>.pid` (fault tests)."""
        server = self.server
        if server is None:
            raise SlimError(f"engine{self.index} was not started")
        server.wait_healthy(self.config.rollout.sglang.server_timeout_s)
        if server.process is not None:
            (self.log_dir / f"engine{self.index}.pid").write_text(str(server.process.pid))
        return server.url

    def start(self) -> str:
        self.spawn()
        return self.wait()

    def healthy(self) -> bool:
        server = self.server
        return server is not None and server.alive() and server.healthy(timeout=5.0)

    def restart(self) -> str:
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self.server is not None:
                self.server.stop()
