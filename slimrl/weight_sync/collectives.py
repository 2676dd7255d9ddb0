"""The trainer-side communication of a weight sync: as strict on gloo as NCCL is, and traced, so
that a sync that can hang on a GPU cluster hangs on CPU too, and a hang names who waits on what.

- **Rendezvous sends.** NCCL's point-to-point send completes only when the receiver has posted its
  receive (for anything above a few KB), and every later operation on the sender's stream waits
  behind it. gloo sends a small tensor eagerly and returns, which hid a deadlock of the old
  funnel (an owner's send pending while a peer waited on it in a gather). Here a send on gloo
  waits for the receiver's acknowledgement.
- **Traced waits.** Every blocking call records what this rank waits in (operation, group, peer,
  export round) in `WAITING`. While a sync runs past `TRACE_AFTER_S`, a watchdog thread writes it
  to `<trace_dir>/rank<R>.json` every second, and the driver, when the sync's deadline passes,
  names every rank and the call it is stuck in (`hang_report`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TRACE_AFTER_S = 5.0
"""A sync still running after this long starts writing what each rank waits in."""

WAITING: dict[str, Any] = {}
"""What this rank is blocked in right now (empty between calls)."""
_ROUND: list[int] = [-1]


def _gloo(group: Any = None) -> bool:
    return dist.get_backend(group) == "gloo"


@contextlib.contextmanager
def waiting_in(op: str, group: str, **where: Any) -> Iterator[None]:
    WAITING.clear()
    WAITING.update(op=op, group=group, round=_ROUND[0], since=time.time(), **where)
    try:
        yield
    finally:
        WAITING.clear()


def set_round(index: int) -> None:
    _ROUND[0] = index


def send(tensor: torch.Tensor, dst: int) -> None:
    """A point-to-point send that returns once `dst` received it, on gloo as on NCCL."""
    with waiting_in("send", "trainer_world", peer=dst):
        dist.send(tensor, dst=dst)
        if _gloo():
            dist.recv(torch.empty(1, dtype=torch.uint8), src=dst)  # the receiver's acknowledgement


def recv(tensor: torch.Tensor, src: int) -> None:
    with waiting_in("recv", "trainer_world", peer=src):
        dist.recv(tensor, src=src)
        if _gloo():
            dist.send(torch.ones(1, dtype=torch.uint8), dst=src)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, name: str = "trainer_world") -> None:
    with waiting_in("broadcast", name, root=src):
        dist.broadcast(tensor, src=src, group=group)


def all_gather_object(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    with waiting_in("all_gather_object", "trainer_world"):
        dist.all_gather_object(out, obj)
    return out


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    with waiting_in("gather_object", "trainer_world", root=dst):
        dist.gather_object(obj, out, dst=dst)
    return out


def all_reduce_max(value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    if not _gloo():
        tensor = tensor.cuda()
    with waiting_in("all_reduce", "trainer_world"):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def barrier(name: str = "trainer_world") -> None:
    with waiting_in("barrier", name):
        dist.barrier()


class Watchdog:
    """While a sync runs past TRACE_AFTER_S, writes this rank's `WAITING` to its trace file."""

    def __init__(self, trace_dir: Path | None, rank: int) -> None:
        self.path = trace_dir / f"rank{rank}.json" if trace_dir else None
        self.rank = rank
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        set_round(-1)
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self._thread = threading.Thread(target=self._watch, name="weight-sync-watchdog", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        assert self.path is not None
        if self._done.wait(TRACE_AFTER_S):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._done.wait(1.0):
            state = {"rank": self.rank, **WAITING} if WAITING else {"rank": self.rank, "op": "computing"}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.path)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def hang_report(trace_dir: Path, world_size: int) -> str:
    """One line: what every rank of a stuck sync waits in, from the watchdogs' trace files."""
    parts = []
    for rank in range(world_size):
        path = trace_dir / f"rank{rank}.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            parts.append(f"rank {rank}: no trace (not in the sync, or its process is gone)")
            continue
        parts.append(f"rank {rank}: {describe(state)}")
    return "; ".join(parts)


def describe(state: dict[str, Any]) -> str:
    op = state.get("op", "?")
    if op == "computing":
        return "not in a collective"
    peer = f" {'to' if op == 'send' else 'from'} rank {state['peer']}" if "peer" in state else ""
    root = f" rooted at rank {state['root']}" if "root" in state else ""
    where = f" of export round {state['round']}" if state.get("round", -1) >= 0 else ""
    return f"waits in {op}{peer}{root} on {state.get('group', '?')}{where}"
