"""Files memory-mapped copy-on-write, opened on first use, whose pages can be dropped from RSS.

Copy-on-write (a private map) so a stray in-place write to a tensor viewing the map can never
reach the file. Streaming readers drop the pages now and then: the maps would otherwise grow the
resident set to the size of everything read (and count against a cgroup limit); a page still in
use simply faults in again from the page cache.
"""

from __future__ import annotations

import mmap
from pathlib import Path


class MappedFiles:
    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def __getitem__(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with Path(path).open("rb") as handle:
                self._maps[path] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[path]

    def release(self) -> None:
        for mapping in self._maps.values():
            mapping.madvise(mmap.MADV_DONTNEED)
