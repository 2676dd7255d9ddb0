"""`make bench`: every benchmark in turn with its default sizes; each prints its own ratios.

python bench/run_all.py [NAME ...]     # e.g. `rl_loop weight_sync` runs only those two
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = [
    "engine",
    "router",
    "router_start",
    "group_requests",
    "packing",
    "trainer",
    "ppo_critic",
    "routing_replay",
    "export",
    "convert",
    "weight_sync",
    "rl_loop",
]


def main() -> int:
    chosen = sys.argv[1:] or BENCHES
    unknown = [name for name in chosen if name not in BENCHES]
    if unknown:
        sys.exit(f"unknown benchmark {', '.join(unknown)}: choose from {', '.join(BENCHES)}")
    failed = []
    for name in chosen:
        print(f"=== bench_{name}", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, str(HERE / f"bench_{name}.py")], cwd=HERE.parent)
        print(f"=== bench_{name}: exit {code} after {time.monotonic() - start:.0f} s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
