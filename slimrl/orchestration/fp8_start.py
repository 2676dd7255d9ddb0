"""The checkpoint an FP8 fleet's engines load, and writing it at start in parallel.

An FP8 fleet starts from a block-FP8 copy of `model.hf_checkpoint` written once per run into
`<run dir>/fp8_start` (`weight_sync/fp8.py`, the one place that knows the format): quantising a
bf16 checkpoint on load would drop the weight loaders every later update needs. The copy is
written before the engines start, aside (`fp8_start.partial`) and then renamed, so a killed run
leaves no half copy; a restarted engine or a resumed run reuses it. The source's safetensors files
are split among workers: under Ray, tasks spread over the training slots' nodes (each reads the
source and writes its shards on the shared filesystem the run directory is on); otherwise a local
process pool.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimrl.config.schema import SlimConfig
from slimrl.devices.launch_plan import Slot

if TYPE_CHECKING:
    from slimrl.orchestration.placement import DeviceSlots
    from slimrl.weight_sync.fp8 import MapParts, PartWritten

logger = logging.getLogger("slimrl")

FP8_START = "fp8_start"
"""The start checkpoint's directory in the run directory."""

WRITER_CPUS = 0.01
"""Ray CPUs a writer task asks of its training slot: the trainer actor already holds the slot
(0.5 of it on CPU, none of its CPU on GPUs), and the task only has to land on the slot's node."""


def serving_path(config: SlimConfig, run_dir: Path | None = None) -> str:
    """The checkpoint every engine's `--model-path` names: `model.hf_checkpoint`, or with
    `rollout.sglang.quantization: fp8` the start copy `<runs_dir>/<run name>/fp8_start`."""
    if config.rollout.sglang.quantization != "fp8":
        return config.model.hf_checkpoint
    run_dir = Path(config.run.runs_dir) / config.run.name if run_dir is None else run_dir
    return str(run_dir / FP8_START)


def serving_checkpoint(config: SlimConfig, run_dir: Path, slots: DeviceSlots | None = None) -> str:
    """The checkpoint the engines start from, written first if it is the FP8 copy and missing:
    by Ray tasks over the training slots `slots` (the run's placement), else by a local pool."""
    target = Path(serving_path(config, run_dir))
    if config.rollout.sglang.quantization != "fp8" or target.exists():
        return str(target)

    from slimrl.weight_sync.fp8 import write_fp8_checkpoint

    partial = run_dir / f"{FP8_START}.partial"  # aside, then renamed: a killed run leaves no half copy
    shutil.rmtree(partial, ignore_errors=True)
    if slots is not None:
        parts, map_parts = config.train_world_size(), ray_map(slots, config.train_world_size())
    else:
        parts, map_parts = os.cpu_count() or 1, local_pool_map
    start = time.perf_counter()
    write_fp8_checkpoint(config.model.hf_checkpoint, partial, parts=parts, map_parts=map_parts)
    partial.rename(target)
    logger.info("FP8 start checkpoint %s written in %.1f s", target, time.perf_counter() - start)
    return str(target)


def spread_slots(layout: Sequence[Slot], count: int) -> list[int]:
    """`count` slot indices taking the nodes in turn (first slot of each node, then the second, ...),
    so the writers share out the nodes' CPUs and network evenly; wraps around when count exceeds
    the slots."""
    by_node: dict[str, list[int]] = {}
    for index, slot in enumerate(layout):
        by_node.setdefault(slot.node, []).append(index)
    order = [i for turn in zip_longest(*by_node.values()) for i in turn if i is not None]
    return [order[k % len(order)] for k in range(count)]


def ray_map(slots: DeviceSlots, train_slots: int) -> MapParts:
    """Run each writer as a Ray task on one of the first `train_slots` slots (the training ranks'),
    spread over their nodes."""

    def run(write: Callable[..., PartWritten], calls: Sequence[tuple[Any, ...]]) -> list[PartWritten]:
        import ray

        task = ray.remote(write)
        placed = spread_slots(slots.layout[:train_slots], len(calls))
        futures = []
        for slot, call in zip(placed, calls, strict=True):
            options = {"num_cpus": WRITER_CPUS, "num_gpus": 0, "scheduling_strategy": slots.strategy(slot)}
            futures.append(task.options(**options).remote(*call))
        return ray.get(futures)

    return run


def local_pool_map(write: Callable[..., PartWritten], calls: Sequence[tuple[Any, ...]]) -> list[PartWritten]:
    """Run each writer in a process of a local pool (spawned: no forked torch or thread state)."""
    if len(calls) == 1:
        return [write(*calls[0])]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(calls), mp_context=context) as pool:
        return list(pool.map(write, *zip(*calls, strict=True)))
