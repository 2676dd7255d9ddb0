"""Real SGLang on a CPU-only machine: the one place that knows what a CPU server needs.

SGLang 0.5.23 serves tiny Qwen3, Qwen3-MoE, Qwen2 and Llama models on CPU with its own torch code
(see docs/rollout.md, "Real SGLang on CPU"). What it needs, and nothing else:
- `SGLANG_USE_CPU_ENGINE=1` plus `--device cpu`: without the variable, model building imports
  vLLM's CUDA ops.
- the `sgl_kernel` stand-in next to this file, first on the server's PYTHONPATH (the PyPI kernel
  wheel is CUDA-only and its import fails without a driver);
- `--attention-backend torch_native` (the x86 default needs the AMX kernels), `--dtype float32`
  (tiny float32 checkpoints are otherwise served in float16) and `--max-total-tokens` (the KV pool
  would otherwise take ~1.7 GB whatever `--mem-fraction-static` says).
- host buffers allocated without CUDA host registration (`host_memory.py`, installed by the
  stand-in's import): `--enable-return-routed-experts` (routing replay) otherwise kills the server.
- a memory saver that loses memory as a GPU does (`memory_saver.py`, installed by the stand-in's
  import): with `--enable-memory-saver` (colocated runs) SGLang's own release/resume code runs, and
  released weights come back as NaN unless `--enable-weights-cpu-backup` kept a host copy
  (torch_memory_saver needs CUDA, and the release's device synchronize crashed without it).
- the GPU kernel packages installed for the GPU path absent from every server process
  (`sitecustomize.py`), as in SGLang's own CPU install.
GPU servers never see any of this: `server_args.py` asks `cpu_launch()` only when the engines run
on CPU.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from slimrl.errors import ConfigError

SGLANG_RELEASE = "0.5.23"
"""The SGLang release slimrl is tested against (the referee in `make test`); pinned in the
`sglang` extra of pyproject.toml."""

STANDIN_DIR = Path(__file__).resolve().parent
"""Directory holding the `sgl_kernel` stand-in package."""

CPU_ATTENTION_BACKEND = "torch_native"
CPU_DTYPE = "float32"
CPU_MAX_TOTAL_TOKENS = 65536
"""KV-cache tokens of one CPU server (a few MB for the tiny models)."""


def check_sglang_version() -> str:
    """The installed SGLang version; one line naming both versions when it is not the pinned one."""
    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"rollout.engine=sglang: SGLang is not installed (needs sglang=={SGLANG_RELEASE}: "
            "pip install -e '.[sglang]')"
        ) from None
    if installed != SGLANG_RELEASE:
        raise ConfigError(
            f"rollout.engine=sglang: installed SGLang {installed} is not the pinned release "
            f"{SGLANG_RELEASE} (pip install sglang=={SGLANG_RELEASE})"
        )
    return installed


def cpu_env() -> dict[str, str]:
    """Environment of a CPU SGLang server process."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(STANDIN_DIR), path) if p),
    }
