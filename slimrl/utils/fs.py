"""Atomic file and directory writes: a crash leaves the old content or the new, never half.

Temporaries are hidden siblings of their target named after their writer
(`.<name>.<pid>@<host>.<random>.tmp`), so the next writer of the same target removes what a
killed one left (`clear_dead_writers`) without touching a live writer's work.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_writers(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to `final` only on success."""
    tmp = temp_sibling(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        replace_directory(tmp, final, overwrite=overwrite)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temp_sibling(final: Path) -> Path:
    """A new hidden directory next to `final` for building it, after clearing dead writers' ones."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    clear_dead_writers(final)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=_temp_prefix(final), suffix=".tmp"))


def replace_directory(tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Rename the finished `tmp` to `final`. An existing `final` is kept aside as `.<name>.old`
    until the new one is in place: killed between the two renames, the next writer puts it back."""
    final = Path(final)
    if not final.exists():
        os.replace(tmp, final)
        return
    if not overwrite:
        raise FileExistsError(final)
    trash = _trash(final)
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(final, trash)
    os.replace(tmp, final)
    shutil.rmtree(trash, ignore_errors=True)


def clear_dead_writers(final: Path) -> list[Path]:
    """Remove the temporaries of `final` whose writer (a process on this host) is gone, and settle
    an interrupted replacement; returns what was removed. Another host's temporaries are left:
    from here nobody can tell whether their writer still runs."""
    final = Path(final)
    prefix, host, removed = f".{final.name}.", socket.gethostname(), []
    for path in final.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid, at, rest = path.name[len(prefix) : -len(".tmp")].partition("@")
        if not (at and pid.isdigit()) or rest.rpartition(".")[0] != host or _alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    trash = _trash(final)
    if trash.exists():
        if final.exists():
            shutil.rmtree(trash, ignore_errors=True)  # the replacement finished; this is the old copy
            removed.append(trash)
        else:
            os.replace(trash, final)  # killed between the renames: the previous version comes back
    return removed


def _temp_prefix(final: Path) -> str:
    return f".{final.name}.{os.getpid()}@{socket.gethostname()}."


def _trash(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
