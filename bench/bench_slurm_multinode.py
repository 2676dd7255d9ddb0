"""Crossing nodes: step time and weight-sync time of GRPO on 2 Slurm nodes vs the same config on 1.

Starts the multi-host test cluster (slurm/local/start_multinode.sh, network-namespace hosts; needs
root), submits `slurm/grpo_moe_256gpu.sh` twice with the tiny MoE (one trainer rank and one engine,
`distributed` weight sync): on 2 nodes (trainer on the head, engine on the other) and on 1 node,
then prints the medians over the steps after the first and the 2-node / 1-node ratios.

python bench/bench_slurm_multinode.py [--steps N]      (default 20)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.slurm_cluster import (  # noqa: E402
    ClusterUnavailable,
    grpo_overrides,
    job_env,
    metrics,
    multinode_cluster,
    new_tag,
    sbatch_args,
    submit_and_wait,
)

KEYS = ("perf/step_seconds", "perf/weight_sync_seconds", "perf/rollout_seconds", "perf/train_seconds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: must be at least 3 (the first step is left out)")
    from slimrl.data.tiny_models import make_tiny
    from slimrl.data.toy_tasks import make_data

    medians: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        root = Path(tmp)
        model, data = root / "model", root / "data.jsonl"
        make_tiny("qwen3_moe", model, seed=0)
        make_data("mod_sum", data, num_samples=512, seed=0)
        try:
            with multinode_cluster(hosts=2) as cluster:
                for label, nodes, slots in (("2 nodes", 2, 1), ("1 node", 1, 2)):
                    runs = root / label.replace(" ", "_")
                    runs.mkdir()
                    grpo = grpo_overrides(model, data, runs, "bench", args.steps, slots)
                    env = job_env(cluster, grpo, new_tag())
                    request = sbatch_args(cluster, nodes, slots, runs, "bench")
                    job = submit_and_wait(cluster, env, request, runs)
                    if job.returncode != 0:
                        print(f"{label}: job {job.job_id} failed\n{job.log[-3000:]}", file=sys.stderr)
                        return 1
                    rows = metrics(runs / "bench")[1:]
                    medians[label] = {key: statistics.median(r[key] for r in rows) for key in KEYS}
                    print(f"{label}: job {job.job_id}, {job.seconds:.0f} s, {args.steps} steps", flush=True)
        except ClusterUnavailable as exc:
            print(f"no multi-host cluster here: {exc}", file=sys.stderr)
            return 3
    print(f"medians over steps 2..{args.steps}, 1 trainer rank + 1 engine, distributed weight sync (gloo)")
    for key in KEYS:
        one, two = medians["1 node"][key], medians["2 nodes"][key]
        print(f"  {key:26s} 1 node {one:7.3f} s   2 nodes {two:7.3f} s   ratio {two / one:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
