"""Conversion throughput vs. the hardware-limit proxy, measured in one run.

Proxy: read every tensor of the HF checkpoint with safetensors and write it back out (same shards).
Ours: `slimrl convert hf-to-mcore` then `mcore-to-hf`, in one process and with `--workers 2`, as a
user runs them. Reports the conversion core (what the CLI times, after start-up) and the whole
command, each as GB/s and as a ratio to the proxy, and the peak RSS of each command's processes
against the goal (half the checkpoint + 1 GB).

Dirty pages are flushed before each timed step (outside the timing), so no step is throttled by an
earlier step's writeback. Every step runs `--repeat` times in interleaved rounds; each speed is the
step's best round (the proxy's too), each RSS its highest.

    python bench/bench_convert.py [--size-gb 1.1] [--workdir /tmp/slimrl-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
from gate import record
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_checkpoint import write_checkpoint


def settle() -> None:
    """Flush dirty pages, so every timed step starts from the same state: gigabytes written by an
    earlier step would otherwise throttle a later one's writes (kernel writeback limits)."""
    os.sync()
    time.sleep(0.5)


def proxy(src: Path, dst: Path) -> float:
    """Read each tensor and write it back, shard by shard; returns seconds."""
    dst.mkdir(parents=True, exist_ok=True)
    settle()
    start = time.perf_counter()
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not a dict)
        save_file(tensors, str(dst / shard.name))
        del tensors
    return time.perf_counter() - start


def run(cmd: list[str]) -> tuple[float, float, int]:
    """(wall seconds, core seconds reported by the CLI, peak RSS bytes of the command's processes)."""
    settle()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    watched = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            family = [watched, *watched.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in family))
        except psutil.Error:
            pass
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(stderr[-2000:])
    core = float(re.search(r"GB in ([0-9.]+) s", stdout).group(1))
    return wall, core, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gb", type=float, default=1.1)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workdir", default="/tmp/slimrl-bench")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each number is the best round")
    args = parser.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    hf = write_checkpoint(work / "hf", args.size_gb)
    nbytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    gb = nbytes / 1e9

    cli = [sys.executable, "-m", "slimrl.cli", "convert"]
    proxies: list[float] = []
    best: dict[tuple[int, str], tuple[float, float, int]] = {}  # fastest core; highest RSS seen
    for _ in range(args.repeat):  # rounds interleave every step, so drift hits them alike
        proxies.append(proxy(hf, work / "proxy"))
        shutil.rmtree(work / "proxy")
        for workers in args.workers:
            mcore, back = work / f"mcore-w{workers}", work / f"back-w{workers}"
            flag = ["--workers", str(workers)]
            to_hf = ["--ckpt", str(mcore), "--out", str(back), "--hf-config-dir", str(hf)]
            steps = {
                "hf_to_mcore": [*cli, "hf-to-mcore", "--hf-dir", str(hf), "--out", str(mcore), *flag],
                "mcore_to_hf": [*cli, "mcore-to-hf", *to_hf, *flag],
            }
            for direction, cmd in steps.items():
                wall, core, rss = run(cmd)
                old = best.get((workers, direction), (wall, core, rss))
                best[(workers, direction)] = (min(wall, old[0]), min(core, old[1]), max(rss, old[2]))
            shutil.rmtree(mcore), shutil.rmtree(back)
    proxy_best = min(proxies)
    goal_rss = nbytes / 2 + 1024**3

    def row(wall: float, core: float, rss: int) -> dict[str, float]:
        return {
            "core_gb_per_s": round(gb / core, 3),
            "core_ratio_to_proxy": round(proxy_best / core, 3),
            "cli_wall_s": round(wall, 2),
            "cli_ratio_to_proxy": round(proxy_best / wall, 3),
            "peak_rss_gb": round(rss / 1e9, 3),
        }

    rows: dict[str, object] = {"checkpoint_gb": round(gb, 3), "proxy_gb_per_s": round(gb / proxy_best, 3)}
    for workers in args.workers:
        rows[f"workers_{workers}"] = {d: row(*best[(workers, d)]) for d in ("hf_to_mcore", "mcore_to_hf")}
    rows["rss_goal_gb"] = round(goal_rss / 1e9, 3)
    print(json.dumps(rows, indent=2))
    gated = {}
    for workers in args.workers:
        for direction, row in rows[f"workers_{workers}"].items():
            for kind in ("core", "cli"):
                gated[f"w{workers}_{direction}_{kind}_vs_proxy"] = row[f"{kind}_ratio_to_proxy"]
    record("convert", gated)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
