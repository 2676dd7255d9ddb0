"""A wait that expired leaves evidence: the Python stacks of every process of the run, saved under
`<run dir>/hang/<UTC time>/`, beside the one line that names who waits on what.

Stacks come from `py-spy dump` (installed with SGLang) for any process, ours or SGLang's. Where it
cannot attach (ptrace restricted for processes that are not its children, e.g. Ray actors under
`kernel.yama.ptrace_scope=1` without root), our own processes dump themselves: each registers
`faulthandler` on `STACK_SIGNAL` at start (`register_stack_signal`), writing every thread's stack to
its own stderr, i.e. its log (Ray forwards actors' stderr to the driver's output).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from slimrl.errors import SlimError

STACK_SIGNAL = signal.SIGUSR2
PY_SPY_TIMEOUT_S = 60.0


class Hung(SlimError):
    """A bounded wait expired: the message names who waits on what."""


def register_stack_signal() -> None:
    """In a process slimrl starts: dump every thread's stack to its stderr (file descriptor 2, what
    its log captures) on `STACK_SIGNAL`. A process without one (an embedding host) is left as is."""
    stream = sys.__stderr__
    try:
        if stream is not None:
            stream.fileno()
            faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True, chain=False)
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        return


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def dump_stacks(pid: int) -> str:
    """The process's Python stacks as text, or why not and where they went instead."""
    spy = _py_spy()
    reason = "py-spy is not installed"
    if spy is not None:
        try:
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S
            )
            if done.returncode == 0:
                return done.stdout
            reason = f"py-spy: {' '.join((done.stderr or done.stdout).split())[:300]}"
        except subprocess.TimeoutExpired:
            reason = f"py-spy did not finish in {PY_SPY_TIMEOUT_S:.0f} s"
    try:
        os.kill(pid, STACK_SIGNAL)
    except OSError as exc:
        return f"no stacks: {reason}; signal: {exc}"
    return f"no stacks here ({reason}): the process wrote them to its own log (signal {STACK_SIGNAL.name})"


def capture(run_dir: Path, processes: Mapping[str, int], line: str) -> Path:
    """Stacks of `processes` (name -> pid) and `line` into a new `hang/<time>/` of `run_dir`."""
    out = Path(run_dir) / "hang" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    for name, pid in processes.items():
        path = out / f"{name}.txt"
        if pid == os.getpid():  # this process: its own stacks, without attaching to itself
            with path.open("w") as handle:
                handle.write(f"# {name}, pid {pid}\n")
                handle.flush()
                faulthandler.dump_traceback(handle, all_threads=True)
            continue
        path.write_text(f"# {name}, pid {pid}\n{dump_stacks(pid)}")
    (out / "summary.txt").write_text(line + "\n")
    return out


def with_stacks(exc: Hung, run_dir: Path, processes: Mapping[str, int]) -> Hung:
    """`exc` with the place its processes' stacks were saved (`capture`)."""
    where = capture(run_dir, processes, str(exc))
    return Hung(f"{exc}; every process's stacks are in {where}")
