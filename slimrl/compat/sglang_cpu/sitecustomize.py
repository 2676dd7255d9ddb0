"""Runs first in every process of a CPU SGLang server (launcher, scheduler, detokenizer: this
directory leads their PYTHONPATH, and Python imports `sitecustomize` at start-up).

GPU-kernel packages that SGLang's own CPU install (`python/pyproject_cpu.toml`) does not have are
made absent here, as they are on SGLang's CPU servers: the CUDA wheels we install beside SGLang for
the GPU path would otherwise be imported by every CPU server process (SGLang guards these imports
for CPU installs), costing ~5 s of CPU per server start for kernels a CPU never runs.
A machine's own `sitecustomize` (shadowed by this one) still runs afterwards.
"""

import os
import sys
from importlib.machinery import PathFinder
from importlib.util import module_from_spec

ABSENT_ON_CPU = ("flashinfer", "cutlass", "quack")
"""`flashinfer-python`, `nvidia-cutlass-dsl` and `quack-kernels`: GPU-only, not in SGLang's CPU
install; `import` of any of them raises ImportError in a CPU server process."""

for _name in ABSENT_ON_CPU:
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]


def _run_shadowed() -> None:
    """The next `sitecustomize` on sys.path (e.g. the distribution's), as if this one were absent."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(module_from_spec(spec))


_run_shadowed()
