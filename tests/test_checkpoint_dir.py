"""Checkpoint directories: pruning by completion order, refusing to reuse an earlier run's
directory silently, and kill -9 at random points of save and prune (issue 13 item 2)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slimrl import checkpoint_dir as ckpt
from slimrl.errors import ConfigError
from tests.conftest import REPO

FILES = 12  # shards per fake checkpoint


def save(root: Path, step: int, keep_last: int = 2) -> Path:
    """What the trainer ranks and the driver do, with fake shards whose content names the step."""
    tmp = ckpt.new_tmp_dir(root, step)
    for i in range(FILES):
        (tmp / f"shard{i}.distcp").write_bytes(f"{step}:{i}".encode() * 4096)
    return ckpt.publish(root, tmp, step, {"step": step}, keep_last)


def whole(path: Path) -> bool:
    """Every shard present with the content of the step the driver state names."""
    step = json.loads((path / ckpt.DRIVER_STATE).read_text())["step"]
    return all(
        (path / f"shard{i}.distcp").read_bytes() == f"{step}:{i}".encode() * 4096 for i in range(FILES)
    )


def test_pruning_follows_completion_order_not_step_numbers(tmp_path) -> None:
    """A run restarted at an earlier step keeps what it just wrote (before: pruned by step number)."""
    root = tmp_path / "ckpt"
    for step in (200, 100, 50):
        save(root, step)
    assert ckpt.complete_checkpoints(root) == ["iter_0000050", "iter_0000100"]
    assert ckpt.latest_checkpoint(root) == root / "iter_0000050"


def test_a_checkpoint_no_run_here_published_is_never_pruned(tmp_path) -> None:
    root = tmp_path / "ckpt"
    foreign = root / "iter_0000999"
    foreign.mkdir(parents=True)
    (foreign / ckpt.DRIVER_STATE).write_text(json.dumps({"step": 999}))
    for step in (1, 2, 3):
        save(root, step, keep_last=1)
    assert ckpt.complete_checkpoints(root) == ["iter_0000003", "iter_0000999"]


def test_keep_last_below_one_is_refused_and_deletes_nothing(tmp_path) -> None:
    root = tmp_path / "ckpt"
    save(root, 1)
    with pytest.raises(ConfigError, match=r"checkpoint.keep_last=0: must be >= 1"):
        save(root, 2, keep_last=0)
    assert ckpt.latest_checkpoint(root) == root / "iter_0000001" and whole(root / "iter_0000001")


def test_a_fresh_start_over_an_earlier_run_is_refused_unless_overwrite(tmp_path) -> None:
    root = tmp_path / "ckpt"
    save(root, 100)
    with pytest.raises(ConfigError) as err:
        ckpt.prepare_start(root, resume=False, overwrite=False)
    assert str(err.value).startswith("checkpoint.resume=false: ") and "checkpoint.overwrite=true" in str(
        err.value
    )
    ckpt.prepare_start(root, resume=True, overwrite=False)  # resuming it is what the directory is for
    ckpt.prepare_start(root, resume=False, overwrite=True)
    assert ckpt.complete_checkpoints(root) == ["iter_0000100"]  # kept until the new run has one
    save(root, 5)
    assert ckpt.complete_checkpoints(root) == ["iter_0000005"]
    assert ckpt.latest_checkpoint(root) == root / "iter_0000005"


SAVER = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.test_checkpoint_dir import save
root, first, last = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
for step in range(first, last + 1):
    save(root, step)
"""


def run_saver(root: Path, first: int, last: int, kill_after: float | None) -> None:
    code = SAVER.format(repo=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(root), str(first), str(last)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    if kill_after is None:
        assert proc.wait(timeout=120) == 0
        return
    time.sleep(kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("seed", range(4))
def test_kill_9_at_a_random_point_of_save_and_prune_loses_nothing(tmp_path, seed: int) -> None:
    root = tmp_path / "ckpt"
    run_saver(root, 1, 2, kill_after=None)
    run_saver(root, 3, 40, kill_after=random.Random(seed).uniform(0.0, 0.6))
    latest = ckpt.latest_checkpoint(root)
    assert latest is not None and whole(latest)  # `latest` always names a whole checkpoint
    for name in ckpt.complete_checkpoints(root):  # nothing that looks complete is half deleted
        assert whole(root / name), name
    step = json.loads((latest / ckpt.DRIVER_STATE).read_text())["step"]
    run_saver(root, step + 1, 42, kill_after=None)  # the resumed run cleans up after the killed one
    assert ckpt.complete_checkpoints(root) == ["iter_0000041", "iter_0000042"]
    assert ckpt.latest_checkpoint(root) == root / "iter_0000042"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []
