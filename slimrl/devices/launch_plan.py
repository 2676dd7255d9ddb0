"""Which node and device every training rank and engine gets, and what each engine process sees.

Pure functions of the config and a node layout (the placement group's slots in (node, device)
order), so the Ray actors and `slimrl train --dry-run` compute the same answer, and tests check
it without GPUs.

The GPU visibility rule:

- A training rank asks Ray for a share of one GPU, so Ray sets `CUDA_VISIBLE_DEVICES` to that
  device: rank r sits on slot r and sees it as `cuda:0`.
- An engine spanning N GPUs must see all N. Ray would set `CUDA_VISIBLE_DEVICES` to the one GPU
  the actor asked for, so engine actors run with `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`
  (Ray's own switch, read by `NvidiaGPUAcceleratorManager`): the actor and its SGLang child see
  the node's GPUs, and `--base-gpu-id` is the CUDA ordinal of the engine's first slot. SGLang
  uses GPUs base .. base + N - 1, which must be the engine's own slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError

NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Ray 2.x: when true in a worker's environment, Ray leaves `CUDA_VISIBLE_DEVICES` alone."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One bundle of the placement group: the node it is on and its device there (Ray's GPU id
    on GPUs, the slot's position on the node on CPU)."""

    node: str
    device: int


@dataclass(frozen=True, slots=True)
class TrainerSeat:
    rank: int
    slot: int
    node: str
    device: int
    visible_devices: str | None
    """`CUDA_VISIBLE_DEVICES` Ray gives the rank (None on CPU)."""


@dataclass(frozen=True, slots=True)
class EngineSeat:
    index: int
    node: str
    slots: tuple[int, ...]
    devices: tuple[int, ...]
    actor_env: dict[str, str] = field(default_factory=dict)
    """Environment of the engine's Ray actor (its server process inherits it)."""

    @property
    def on_gpu(self) -> bool:
        return NOSET_CUDA_VISIBLE_DEVICES in self.actor_env

    def base_gpu_id(self, visible: str | None = None) -> int:
        """CUDA ordinal of the first device, as the server process sees it (`visible`: the
        `CUDA_VISIBLE_DEVICES` the node's processes inherit, e.g. from Slurm; None = all)."""
        return engine_base_gpu_id(self.devices, visible)


def simulated_layout(config: SlimConfig) -> list[Slot]:
    """The layout of a cluster as the config describes it: node n holds devices 0..G-1."""
    per_node = config.cluster.gpus_per_node
    return [Slot(f"node{n}", d) for n in range(config.cluster.num_nodes) for d in range(per_node)]


def order_slots(locations: Sequence[tuple[str, int]], use_gpu: bool) -> tuple[list[int], list[Slot]]:
    """Bundle indices sorted by (node, device), and the layout in that order. CPU bundles have no
    device id, so there a slot's device is its position on its node."""
    order = sorted(range(len(locations)), key=lambda i: (locations[i][0], locations[i][1], i))
    layout: list[Slot] = []
    for i in order:
        node, device = locations[i]
        on_node = sum(1 for s in layout if s.node == node)
        layout.append(Slot(node, device if use_gpu else on_node))
    return order, layout


def trainer_seats(config: SlimConfig, layout: Sequence[Slot], device: str) -> list[TrainerSeat]:
    """Rank r on slot r; on GPUs Ray makes that slot's GPU the only one it sees."""
    seats = []
    for rank in range(config.train_world_size()):
        slot = layout[rank]
        visible = str(slot.device) if device == "cuda" else None
        seats.append(TrainerSeat(rank, rank, slot.node, slot.device, visible))
    return seats


def engine_actor_env(device: str) -> dict[str, str]:
    """On GPUs: keep Ray from narrowing `CUDA_VISIBLE_DEVICES` to the actor's one bundle."""
    return {NOSET_CUDA_VISIBLE_DEVICES: "1"} if device == "cuda" else {}


def engine_seats(config: SlimConfig, layout: Sequence[Slot], device: str) -> list[EngineSeat]:
    """Engine i takes `gpus_per_engine` consecutive slots from `engine_first_slot`; they must be
    on one node (the config checks refuse layouts where they would not be)."""
    per_engine = config.rollout.gpus_per_engine
    first = config.engine_first_slot()
    seats = []
    for index in range(config.rollout.num_engines):
        slots = tuple(range(first + index * per_engine, first + (index + 1) * per_engine))
        nodes = {layout[s].node for s in slots}
        if len(nodes) != 1:
            raise SlimError(f"engine {index}: slots {slots} span nodes {sorted(nodes)}")
        devices = tuple(layout[s].device for s in slots)
        seats.append(EngineSeat(index, layout[slots[0]].node, slots, devices, engine_actor_env(device)))
    return seats


def engine_base_gpu_id(devices: Sequence[int], visible: str | None = None) -> int:
    """`--base-gpu-id` for an engine on `devices` (physical ids); SGLang then uses the ordinals
    base .. base + N - 1, so the devices must be consecutive in the visible order."""
    ordinals = list(devices)
    if visible:
        order = [d.strip() for d in visible.split(",")]
        missing = [d for d in devices if str(d) not in order]
        if missing:
            raise SlimError(f"engine GPUs {missing} are not in CUDA_VISIBLE_DEVICES={visible}")
        ordinals = [order.index(str(d)) for d in devices]
    if ordinals != list(range(ordinals[0], ordinals[0] + len(ordinals))):
        raise SlimError(f"engine GPUs {list(devices)} are not consecutive (CUDA_VISIBLE_DEVICES={visible})")
    return ordinals[0]
