"""Ray: start or join a cluster, and one placement group whose bundles map ranks to devices.

Bundles are re-sorted by (node IP, device id) so logical rank r always lands on the same physical
device. On a CPU-only machine every bundle is one CPU slot and "device id" is its position on the
node. Which slots each rank and engine takes, and what it sees, is `launch_plan`'s business.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.devices.launch_plan import EngineSeat, Slot, order_slots
from slimrl.devices.ledger import Ledger, build_ledger
from slimrl.devices.rank_groups import Sizes
from slimrl.devices.rules import check_ledger
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.parallel_layout import ParallelLayout
from slimrl.rollout.sglang.server_args import sglang_env
from slimrl.utils.faults import FAULT_VARS

logger = logging.getLogger(__name__)

# Share of a device each side takes when colocated: both fit in one bundle.
TRAIN_SHARE_COLOCATED = 0.5
ROLLOUT_SHARE_COLOCATED = 0.4


def worker_env(device: str) -> dict[str, str]:
    """Environment every actor process starts with."""
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if device == "cpu":
        # Two cores shared by several processes: one intra-op thread each avoids oversubscription.
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    env.update({k: os.environ[k] for k in FAULT_VARS if k in os.environ})  # a test's or drill's fault
    return env


TRAINER_DETERMINISM_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
"""Transformer Engine picks only deterministic kernels (fused attention backward without atomics)
with this; Megatron-Core's TE attention refuses to build under `deterministic_mode` without it."""


def trainer_env(config: SlimConfig, device: str) -> dict[str, str]:
    """Extra environment of every trainer rank, on top of `worker_env` (Ray merges a per-actor
    `runtime_env` into the job's). True on-policy on GPUs: the engines' deterministic collectives
    and cuBLAS workspaces (`sglang_env`) plus `TRAINER_DETERMINISM_ENV`; nothing otherwise."""
    if device != "cuda" or not config.algorithm.true_on_policy:
        return {}

    return {**sglang_env(config), **TRAINER_DETERMINISM_ENV}


NO_PRESTART = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
"""Ray starts idle workers ahead of demand by default (one per CPU for the first driver): ours
all run in placement groups with their own options, so none ever uses one, and each costs a
Python start (~2 s of CPU) and ~130 MB while the run starts."""


def start_ray(config: SlimConfig, device: str, slots_needed: int) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": worker_env(device)}
    if config.ray.address:
        logger.info("joining Ray cluster at %s", config.ray.address)
        ray.init(address=config.ray.address, runtime_env=env, log_to_driver=True)
        return
    num_cpus = config.ray.num_cpus or max(os.cpu_count() or 1, slots_needed) + 2
    # A Ray of our own inherits this process's environment: set here, it reaches every worker
    # without a job `runtime_env`, which Ray applies by starting each worker through one more
    # Python process (setup_worker.py, ~1 s of CPU per actor).
    os.environ.update(env["env_vars"])
    # address="local": a new Ray of this run's own. Left to its default, ray.init joins whatever
    # cluster RAY_ADDRESS or the last `ray start` on this machine names (another user's job, a
    # test's cluster) and then refuses num_cpus.
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        _system_config=NO_PRESTART,
    )


@dataclass
class DeviceSlots:
    """The placement group, its bundle indices in (node, device) order, and where each is."""

    placement_group: Any
    ordered_bundles: list[int]
    use_gpu: bool
    layout: list[Slot] = field(default_factory=list)
    """Node and device of each slot, in slot order (what `launch_plan` computes seats from)."""
    uuids: dict[tuple[str, int], str] = field(default_factory=dict)
    """GPU UUID of each (node, device) on GPUs (the device ledger's); empty on CPU."""

    def strategy(self, slot: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=self.ordered_bundles[slot],
        )

    def resources(self, share: float) -> dict[str, float]:
        """Actor resource request for `share` of one slot."""
        return {"num_gpus": share, "num_cpus": 0} if self.use_gpu else {"num_cpus": share}


def engine_actor_options(slots: DeviceSlots, seat: EngineSeat, share: float) -> dict[str, Any]:
    """Ray options of an engine actor: `share` of its first slot, and on GPUs the switch that
    keeps Ray from narrowing `CUDA_VISIBLE_DEVICES` to that one slot (per-actor env vars are
    merged into the job's)."""
    options: dict[str, Any] = {"scheduling_strategy": slots.strategy(seat.slots[0]), **slots.resources(share)}
    if seat.actor_env:
        options["runtime_env"] = {"env_vars": dict(seat.actor_env)}
    return options


def trainer_actor_options(slots: DeviceSlots, rank: int, share: float, env: dict[str, str]) -> dict[str, Any]:
    """Ray options of trainer rank `rank`: `share` of its slot, and `env` (`trainer_env`) as its
    per-actor environment, merged by Ray into the job's."""
    options: dict[str, Any] = {"scheduling_strategy": slots.strategy(rank), **slots.resources(share)}
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return options


def _bundle_location() -> tuple[str, str, int, str | None]:
    """(node IP, Ray node id, GPU id, GPU UUID) of the bundle this probe runs in; Ray narrows
    `CUDA_VISIBLE_DEVICES` to the bundle's GPU, so `cuda:0` is that GPU."""
    import ray

    gpu_ids = ray.get_gpu_ids()
    node_id = ray.get_runtime_context().get_node_id()
    uuid = None
    if gpu_ids:
        import torch

        if torch.cuda.is_available():  # Ray's fake GPU resources (tests) have no device behind them
            uuid = str(torch.cuda.get_device_properties(0).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return ray.util.get_node_ip_address(), node_id, int(gpu_ids[0]) if gpu_ids else 0, uuid


def _cpu_bundle_locations(group: Any, num_slots: int) -> list[tuple[str, str, int, str | None]]:
    """`_bundle_location` of CPU bundles from Ray's placement-group table: a CPU bundle has no
    device to see from inside, and a probe task per bundle cost a worker process start per slot."""
    import ray
    from ray.util import placement_group_table

    node_of = placement_group_table(group)["bundles_to_node_id"]
    ip_of = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return [(ip_of[node_of[i]], node_of[i], 0, None) for i in range(num_slots)]


def node_labels(probes: list[tuple[str, str, int]]) -> list[tuple[str, int]]:
    """(node, device) per bundle: nodes named by IP, plus a short node id where one IP hosts
    several Ray nodes (test clusters), so bundles of different nodes never look alike."""
    ids_of: dict[str, set[str]] = {}
    for ip, node_id, _ in probes:
        ids_of.setdefault(ip, set()).add(node_id)
    return [(ip if len(ids_of[ip]) == 1 else f"{ip}/{node_id[:8]}", dev) for ip, node_id, dev in probes]


def run_ledger(config: SlimConfig, slots: DeviceSlots, device: str) -> Ledger:
    """The device ledger of the placement Ray gave this run (its nodes, its GPUs' UUIDs), checked
    by the GPU's rules like the config's own layout was at load."""

    arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
    layout = ParallelLayout.resolve(config.parallel, config.train_world_size(), arch)
    transport = config.rollout.weight_sync if config.algorithm.loss == "policy" else None  # finalized
    ledger = build_ledger(config, slots.layout, device, Sizes.of(layout), transport, slots.uuids or None)
    check_ledger(ledger)
    return ledger


def create_device_slots(num_slots: int, use_gpu: bool) -> DeviceSlots:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(num_slots)], strategy="PACK")
    ray.get(group.ready(), timeout=300)
    if use_gpu:  # which GPU each bundle got, and its UUID, only a process inside it can see
        probe = ray.remote(_bundle_location)
        refs = []
        for index in range(num_slots):
            where = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            refs.append(probe.options(num_cpus=0.01, num_gpus=0.01, scheduling_strategy=where).remote())
        probes = ray.get(refs)
    else:
        probes = _cpu_bundle_locations(group, num_slots)
    labels = node_labels([probe[:3] for probe in probes])
    order, layout = order_slots(labels, use_gpu)
    uuids = {(node, dev): probe[3] for (node, dev), probe in zip(labels, probes, strict=True) if probe[3]}
    return DeviceSlots(
        placement_group=group, ordered_bundles=order, use_gpu=use_gpu, layout=layout, uuids=uuids
    )
