"""Start inference servers for tests through slimrl's own launch code: the real SGLang server
(`rollout.engine=sglang`, the referee) or the embedded engine. Nothing here imitates SGLang.
`hf_routing` is the referee of routed experts: Hugging Face's own router."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import requests
import torch

from slimrl.compat.sglang_cpu import SGLANG_RELEASE
from slimrl.preflight import load_config
from slimrl.rollout.servers import ServerProcess, start_server
from tests.conftest import free_port

ENGINES = ("sglang", "embedded")
"""Every contract test runs on both; real SGLang's behaviour is the reference."""

START_TIMEOUT_S = 240.0


def engine_config(kind: str, model: Path, *overrides: str):
    return load_config(None, [f"model.hf_checkpoint={model}", f"rollout.engine={kind}", *overrides])


def start_engine(kind: str, model: Path, log_dir: Path, index: int = 0, *overrides: str) -> ServerProcess:
    """Start one server and wait until it answers; on failure the error carries the log tail. A
    real SGLang server proves it is one before any test talks to it."""
    config = engine_config(kind, model, *overrides)
    log = log_dir / f"{kind}{index}-{free_port()}.log"
    server = start_server(config, str(model), log, index, START_TIMEOUT_S)
    if kind == "sglang":
        assert server.process is not None
        assert_real_sglang(server.url, server.process.pid)
    return server


def assert_real_sglang(url: str, pid: int | None = None) -> None:
    """The server at `url` is SGLang 0.5.23 itself, by its own word and its process: the embedded
    engine reports `engine: slimrl-embedded` and slimrl's version, and runs `slimrl serve`."""
    info = requests.get(f"{url}/get_server_info", timeout=60).json()
    assert info.get("version") == SGLANG_RELEASE and "engine" not in info, (url, info.get("version"))
    if pid is not None:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"sglang.launch_server" in argv, argv


def assert_sglang_log(log: Path) -> None:
    """An engine log a run wrote is real SGLang's (its start-up lines, none of the embedded's)."""
    text = log.read_text(errors="replace")
    assert "server_args={'model_path'" in text and "Load weight end." in text, f"{log}: not SGLang's log"
    assert "slimrl-embedded:" not in text, f"{log}: the embedded engine answered"


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


@functools.lru_cache(maxsize=2)
def _hf_model(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_routing(model_path: str | Path, tokens: list[int]) -> np.ndarray:
    """The referee: Hugging Face's Qwen3-MoE run on every token but the last (the ones an engine
    feeds), top-k of its own router logits as its router computes it (softmax in float32, top-k)."""
    model = _hf_model(str(model_path))
    with torch.no_grad():
        out = model(torch.tensor([tokens[:-1]]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    chosen = [
        torch.topk(torch.softmax(logits, -1, dtype=torch.float), k, dim=-1).indices
        for logits in out.router_logits
    ]
    return torch.stack(chosen, dim=1).numpy()
