"""The installed SGLang is the pinned referee (serving on CPU is covered by the contract suite,
`tests/test_engine_contract.py`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess

from slimrl.compat.sglang_cpu import SGLANG_RELEASE, check_sglang_version, cpu_env
from tests.conftest import PYTHON, REPO


def test_installed_sglang_is_the_pinned_referee() -> None:
    assert check_sglang_version() == SGLANG_RELEASE


def test_cpu_server_processes_lack_the_gpu_kernel_packages_as_sglang_s_cpu_install_does() -> None:
    """The CUDA kernel packages installed for the GPU path (flashinfer, the CUTLASS DSL, quack) are
    absent in a CPU server's processes, as in SGLang's own CPU install (`pyproject_cpu.toml` has
    none of them): SGLang's guarded import finds no flashinfer (its FP4 quantizer is None), while
    they are installed, and found outside a server."""
    code = (
        "import sys; import sglang.srt.layers.quantization.fp4_utils as f; "
        "print(f.fp4_quantize is None, [n for n in ('flashinfer', 'cutlass', 'quack') if sys.modules.get(n)])"
    )
    server = subprocess.run([PYTHON, "-c", code], env={**os.environ, **cpu_env()}, capture_output=True,
                            text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert server.stdout.split("\n")[-2] == "True []", server.stdout[-2000:] + server.stderr[-2000:]
    assert all(importlib.util.find_spec(name) for name in ("flashinfer", "cutlass", "quack"))
