"""Router start-up: seconds until sglang-router answers `/liveness`, and the CPU seconds its process
spent getting there, started by sglang-router's own launcher (`sglang_router.launch_router`, which
imports SGLang through its Python debug balancer) vs. ours (`slimrl.rollout.router_main`, the same
Rust router and argument parser without that import). Every run, `slimrl train` and `slimrl rollout`
start one router while the engines and trainer ranks load on the same cores.

    python bench/bench_router_start.py [--rounds 5]

Rounds alternate between the launchers; prints a JSON table with the medians and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests
from gate import record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slimrl.rollout.router import router_command  # noqa: E402
from slimrl.rollout.servers import ServerProcess  # noqa: E402
from slimrl.utils.net import free_port  # noqa: E402

LAUNCHERS = {"sglang_router.launch_router": "upstream", "slimrl.rollout.router_main": "ours"}


def start_once(module: str, model_dir: Path, log: Path) -> tuple[float, float]:
    """(seconds until /liveness answers, CPU seconds of the router process by then)."""
    port = free_port()
    command = router_command("127.0.0.1", port, str(model_dir), "round_robin")
    command[command.index("slimrl.rollout.router_main")] = module
    process = ServerProcess(name="router", command=command, host="127.0.0.1", port=port, log_path=log)
    start = time.perf_counter()
    process.start()
    try:
        while True:
            try:
                if requests.get(f"{process.url}/liveness", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.perf_counter() - start > 120:
                raise SystemExit(f"{module}: router not up after 120 s ({log})")
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        assert process.process is not None
        cpu = psutil.Process(process.process.pid).cpu_times()
        return seconds, cpu.user + cpu.system
    finally:
        process.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from slimrl.data.tiny_models import make_tiny

    results: dict[str, list[tuple[float, float]]] = {name: [] for name in LAUNCHERS.values()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny("qwen3_moe", Path(tmp) / "model")
        for _ in range(args.rounds):
            for module, name in LAUNCHERS.items():
                results[name].append(start_once(module, model_dir, Path(tmp) / f"{name}.log"))
    medians = {
        name: {
            "ready_s": round(statistics.median(r[0] for r in runs), 3),
            "cpu_s": round(statistics.median(r[1] for r in runs), 3),
        }
        for name, runs in results.items()
    }
    table = {
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "rows": [{"launcher": name, **values} for name, values in medians.items()],
        "ready_ours_vs_upstream": round(medians["ours"]["ready_s"] / medians["upstream"]["ready_s"], 3),
        "cpu_ours_vs_upstream": round(medians["ours"]["cpu_s"] / medians["upstream"]["cpu_s"], 3),
    }
    print(json.dumps(table, indent=2))
    # the upstream launcher over ours: higher is better
    record("router_start", {"upstream_vs_ours_ready": 1 / table["ready_ours_vs_upstream"],
                            "upstream_vs_ours_cpu": 1 / table["cpu_ours_vs_upstream"]})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
