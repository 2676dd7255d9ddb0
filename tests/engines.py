"""Start inference servers for tests through slimrl's own launch code: the real SGLang server
(`rollout.engine=sglang`, the referee) or the embedded engine. Nothing here imitates SGLang."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from slimrl.config import load_config
from slimrl.rollout.servers import ServerProcess, start_server
from tests.conftest import free_port

ENGINES = ("sglang", "embedded")
"""Every contract test runs on both; real SGLang's behaviour is the reference."""

START_TIMEOUT_S = 240.0


def engine_config(kind: str, model: Path, *overrides: str):
    return load_config(None, [f"model.hf_checkpoint={model}", f"rollout.engine={kind}", *overrides])


def start_engine(kind: str, model: Path, log_dir: Path, index: int = 0, *overrides: str) -> ServerProcess:
    """Start one server and wait until it answers; on failure the error carries the log tail."""
    config = engine_config(kind, model, *overrides)
    log = log_dir / f"{kind}{index}-{free_port()}.log"
    return start_server(config, str(model), log, index, START_TIMEOUT_S)


@contextlib.contextmanager
def running_engines(
    kind: str, model: Path, log_dir: Path, count: int = 1, *overrides: str
) -> Iterator[list[str]]:
    servers: list[ServerProcess] = []
    try:
        for index in range(count):
            servers.append(start_engine(kind, model, log_dir, index, *overrides))
        yield [s.url for s in servers]
    finally:
        for server in servers:
            server.stop()
