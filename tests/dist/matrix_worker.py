"""torchrun (or per-host) worker of the transport x layout matrix: for each (mode, transport) of a
plan, the device ledger of that mode's layout is checked; a refused one must be refused by the
GPU's rules both at load (`check_ledger`) and by the transport before it opens anything; an
accepted one trains a step (so the weights move), pushes them to the running engines over that
transport within a deadline, and scores what the engines sample after it.

Usage: worker OUT_DIR ENGINE_URLS(comma) SYNC_ROOT PLAN_JSON key=value ...
PLAN_JSON: [{"mode": "colocated"|"disaggregated", "transport": ..., "expect": "ok"|"refused",
"hosts": 1|2}, ...]. With hosts=2 the ranks and engines are split over two nodes as the ledger
of a two-node layout says (the test starts them there). Rank 0 writes OUT_DIR/rank0.json.
"""

import faulthandler
import json
import os
import sys
import threading
from pathlib import Path

import requests
import torch.distributed as dist
from sync_worker import PROMPTS, RESPONSES, sample_all

from slimrl.preflight import load_config
from slimrl.devices.launch_plan import simulated_layout
from slimrl.devices.ledger import build_ledger
from slimrl.devices.rank_groups import Sizes
from slimrl.devices.rules import GpuRuleError, check_ledger
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import PerToken, TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed
from slimrl.weight_sync import collectives
from slimrl.weight_sync.transports import close_weight_sync_group

SYNC_DEADLINE_S = 180.0
RECORDER: "Recorder"


def mode_config(base: list[str], mode: str, world: int, engines: int, hosts: int):
    """The config of `mode`'s layout: `hosts` nodes; colocated engines on the trainer's slots,
    disaggregated ones on slots of their own after the trainer's (on the last node)."""
    per_node = world // hosts if mode == "colocated" else (world + engines) // hosts
    layout = [f"cluster.num_nodes={hosts}", f"cluster.gpus_per_node={per_node}",
              f"rollout.num_engines={engines}", "rollout.gpus_per_engine=1"]  # fmt: skip
    if mode == "colocated":
        layout += ["cluster.colocate=true"]
    else:
        layout += ["cluster.colocate=false", f"cluster.rollout_gpus={engines}"]
    return load_config(None, [*base, *layout, "rollout.weight_sync=disk"])  # transport: checked below


def train_step(actor: MegatronActor, sign: float) -> None:
    dp, dp_rank = actor.layout.dp, actor.coordinates()["dp"]
    seqs = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)] * 2
    lengths = [len(r) for r in RESPONSES] * 2
    mine = list(range(dp_rank, len(seqs), dp))
    batch = TrainBatch(
        tokens=[seqs[i] for i in mine],
        response_lengths=[lengths[i] for i in mine],
        loss_masks=[[1] * lengths[i] for i in mine],
        per_token=PerToken(advantages=[[sign if i % 2 else -sign] * lengths[i] for i in mine]),
        global_num_tokens=sum(lengths),
        global_num_seqs=len(seqs),
    )
    batch.per_token.rollout_logp = [[0.0] * n for n in batch.response_lengths]
    actor.train_rl(batch)


class Recorder:
    """Every trainer-side collective and point-to-point call of a push, with its group's trainer
    ranks and the export round it ran in (`tests/nccl_model.py` checks them under NCCL's rules)."""

    NAMES = ("all_gather", "broadcast", "send", "recv", "all_gather_object", "gather_object", "barrier",
             "all_reduce")  # fmt: skip

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, list[int]]] = []
        self.active = False
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, real):
        def traced(*args, **kwargs):
            if self.active:
                self.calls.append((collectives._ROUND[0], name, self._members(name, args, kwargs)))
            return real(*args, **kwargs)

        return traced

    @staticmethod
    def _members(name, args, kwargs) -> list[int]:
        from slimrl.weight_sync import transports

        if name in ("send", "recv"):
            return [kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))]
        group = kwargs.get("group")
        if transports._BROADCAST_GROUP and group is transports._BROADCAST_GROUP[0].group:
            return [-1]  # rank 0 and the engines: not a trainer group
        return (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )


def bounded_push(actor, urls, transport, version, sync_dir, trace_dir) -> dict:
    """The push, or one line naming what every rank waits in once the deadline passes."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(SYNC_DEADLINE_S) and dist.get_rank() == 0:
            print(f"HUNG: {collectives.hang_report(trace_dir, dist.get_world_size())}", flush=True)
            faulthandler.dump_traceback()
            os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    RECORDER.calls.clear()
    RECORDER.active = True
    try:
        return actor.push_weights(urls, transport, version, sync_dir, str(trace_dir))
    finally:
        RECORDER.active = False
        done.set()


def main() -> None:
    global RECORDER
    RECORDER = Recorder()
    out_dir, urls, sync_root = Path(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3])
    plan = json.loads(sys.argv[4])
    base = sys.argv[5:]
    config = load_config(None, base)
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=2 * len(plan) + 2)
    sizes = Sizes.of(actor.layout)
    results = []
    temperature = config.rollout.sampling.temperature or 1.0
    for step, case in enumerate(plan):
        mode_cfg = mode_config(base, case["mode"], info.world_size, len(urls), case.get("hosts", 1))
        ledger = build_ledger(mode_cfg, simulated_layout(mode_cfg), "cpu", sizes, case["transport"])
        outcome: dict = dict(case)
        try:
            check_ledger(ledger)
            outcome["load"] = "accepted"
        except GpuRuleError as exc:
            outcome["load"] = str(exc)
        actor.ledger = ledger  # the run would have stopped at load; the transport must refuse too
        train_step(actor, 1.0 if step % 2 else -1.0)
        before = sample_all(urls, temperature) if info.rank == 0 else None
        version = f"v{step + 1}"
        try:
            sync = bounded_push(actor, urls, case["transport"], version, str(sync_root / version),
                                out_dir / "trace")  # fmt: skip
        except GpuRuleError as exc:
            outcome["push"] = str(exc)
            results.append(outcome)
            continue
        outcome["push"] = "done"
        outcome["seconds"] = sync["seconds"]
        traces: list = [None] * info.world_size
        dist.all_gather_object(traces, list(RECORDER.calls))
        outcome["trace"] = traces
        shared: list = [sample_all(urls, temperature) if info.rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        after = shared[0]
        scoring = TrainBatch(
            tokens=[p + tokens for p, (tokens, _) in zip(PROMPTS * len(urls), after, strict=True)],
            response_lengths=[len(tokens) for tokens, _ in after],
            loss_masks=[[1] * len(tokens) for tokens, _ in after],
        )
        scored: list = [None] * info.world_size  # the last pipeline stage scores
        dist.all_gather_object(scored, actor.response_logprobs(scoring))
        trainer = {i: logps for part in scored for i, logps in part.items()}
        if info.rank == 0:
            assert before is not None
            outcome["diff"] = max(
                abs(a - b)
                for i, (_, engine) in enumerate(after)
                for a, b in zip(engine, trainer[i], strict=True)
            )
            outcome["moved"] = max(abs(a[1][0] - b[1][0]) for a, b in zip(after, before, strict=True))
            outcome["versions"] = [
                requests.get(f"{u}/get_model_info", timeout=10).json().get("weight_version") for u in urls
            ]
        results.append(outcome)
    pids: list = [None] * info.world_size  # the creators of this run's shared-memory segments
    dist.all_gather_object(pids, os.getpid())
    if info.rank == 0:
        close_weight_sync_group(actor_calls(config), urls)
        (out_dir / "rank0.json").write_text(json.dumps(results))
        (out_dir / "pids.json").write_text(json.dumps(pids))
    destroy_distributed()


def actor_calls(config):
    from slimrl.weight_sync.engines import EngineCalls

    return EngineCalls(config.rollout.api_key, config.rollout.admin_api_key)


if __name__ == "__main__":
    main()
