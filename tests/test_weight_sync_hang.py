"""A weight sync that hangs names itself: every blocking call of a sync records what it waits in,
each rank's watchdog writes it down once the sync runs long, and the driver's line names every
rank's wait. Two real gloo ranks deadlock for real here (each receives from the other)."""

from __future__ import annotations

import subprocess
import time

from slimrl.utils import hang
from slimrl.weight_sync import collectives
from tests.conftest import PYTHON, REPO, free_port

RANK = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from slimrl.weight_sync import collectives
rank, port, trace = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
with collectives.Watchdog(trace, rank):
    collectives.set_round(3)
    collectives.recv(torch.empty(4), src=1 - rank)  # both receive: a deadlock
"""


def test_a_deadlocked_sync_is_one_line_naming_every_ranks_wait(tmp_path):
    port = free_port()
    ranks = [
        subprocess.Popen(
            [PYTHON, "-c", RANK, str(r), str(port), str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.json").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, [p.poll() for p in ranks]
            assert all(p.poll() is None for p in ranks), [p.communicate()[0][-2000:] for p in ranks]
            time.sleep(0.2)
        line = collectives.hang_report(tmp_path, 2)
        where = hang.capture(tmp_path / "run", {"rank0": ranks[0].pid, "rank1": ranks[1].pid}, line)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert line == (
        "rank 0: waits in recv from rank 1 on trainer_world of export round 3; "
        "rank 1: waits in recv from rank 0 on trainer_world of export round 3"
    )
    assert collectives.hang_report(tmp_path / "nothing", 1).startswith("rank 0: no trace")
    # ... and every process's Python stacks beside it (py-spy, which SGLang installs): each rank
    # is seen inside the receive of our collectives module
    assert where.parent == tmp_path / "run" / "hang" and (where / "summary.txt").read_text() == line + "\n"
    for rank in (0, 1):
        stacks = (where / f"rank{rank}.txt").read_text()
        assert stacks.startswith(f"# rank{rank}, pid {ranks[rank].pid}"), stacks[:500]
        assert "recv (slimrl/weight_sync/collectives.py" in stacks, stacks[:2000]
