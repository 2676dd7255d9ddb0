"""The rollout fleet of `slimrl train`, as the driver sees it: one `EngineProcess` per server as a Ray
actor on its node, and the rollout manager actor that holds the `FleetFront` (router, client)
and runs the rollouts. The parts are `slimrl rollout`'s (`rollout/fleet.py`); what differs is
where they live, and that an engine can be lost with its node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.devices.launch_plan import engine_seats
from slimrl.errors import SlimError
from slimrl.orchestration.placement import DeviceSlots, engine_actor_options

logger = logging.getLogger("slimrl")


class EngineLost(SlimError):
    """An engine's Ray actor is gone, with its node: the run stops (resumable) rather than wait."""


class RayFleet:
    def __init__(
        self,
        config: SlimConfig,
        slots: DeviceSlots,
        first_slot: int,
        run_dir: Path,
        share: float,
        model_path: str,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from slimrl.orchestration.rollout_manager import EngineActor, RolloutManager

        self.config = config
        log_dir = str(run_dir / "logs")
        seats = engine_seats(config, slots.layout, "cuda" if slots.use_gpu else "cpu")
        assert not seats or seats[0].slots[0] == first_slot, (seats[0].slots, first_slot)
        remote = ray.remote(EngineActor)
        self.seats, self.engines = seats, []
        self.lost: set[int] = set()
        """Engines whose Ray actor is gone (with its node): they cannot be restarted or stopped."""
        for seat in seats:  # on GPUs each sees its node's GPUs (launch_plan.py)
            options = remote.options(**engine_actor_options(slots, seat, share))
            self.engines.append(options.remote(config, seat.index, log_dir, seat, model_path))
        started = [e.start.remote() for e in self.engines]
        # The manager (tokenizer, data, router process) comes up while the engines load, on the
        # driver's node: it holds the run's data state and must outlive any engine node.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        manager = ray.remote(RolloutManager).options(num_cpus=0, max_concurrency=8, scheduling_strategy=here)
        self.manager = manager.remote(config, log_dir)
        self.restarts = 0
        self.urls: list[str] = []
        try:
            self.urls = ray.get(started)
            ray.get(self.manager.connect.remote(self.urls))
        except BaseException:
            self.shutdown()  # the engines and the router that did start
            raise

    def heal(self, before_restart: Callable[[], None] | None = None) -> list[int]:
        """Restart engines that died; swap them into the router and client. Returns their indices.
        `before_restart` runs once before the first restart (colocated: make room on the devices)."""
        import ray

        replaced, restarted = [], []
        for index, ok in enumerate(self.health()):
            if ok:
                continue
            if before_restart is not None and not restarted:
                before_restart()
            logger.warning("engine %d at %s is dead: restarting it", index, self.urls[index])
            new_url = ray.get(self.engines[index].restart.remote())
            replaced.append((self.urls[index], new_url))
            self.urls[index] = new_url
            self.restarts += 1
            restarted.append(index)
        ray.get(self.manager.swap.remote(replaced, self.urls))  # every engine answers now
        return restarted

    def health(self) -> list[bool]:
        """Whether each engine's server answers. A server that died is restarted by its actor; an
        actor that is gone took its node (or raylet) with it, and nothing here can bring it back:
        EngineLost names it."""
        import ray
        from ray.exceptions import RayActorError

        checks = [e.healthy.remote() for e in self.engines]
        healthy = []
        for index, check in enumerate(checks):
            try:
                healthy.append(bool(ray.get(check)))
            except RayActorError:
                self.lost.add(index)
                raise EngineLost(self._lost_line(index)) from None
        return healthy

    def _lost_line(self, index: int) -> str:
        import ray

        node = self.seats[index].node.split("/")[0]
        names = [n["NodeManagerHostname"] for n in ray.nodes() if n["NodeManagerAddress"] == node]
        where = f"{names[0]} ({node})" if names else node
        return f"engine {index} ({self.urls[index]}) is lost with its node {where}: its Ray actor is gone"

    def control(
        self, endpoint: str, payload: dict[str, Any] | None = None, only: Sequence[int] | None = None
    ) -> None:
        """A control call to every engine, or to engines `only` (indices)."""
        import ray

        urls = None if only is None else [self.urls[i] for i in only]
        ray.get(self.manager.control.remote(endpoint, payload, urls))

    def shutdown(self) -> None:
        import ray

        engines = [e for i, e in enumerate(self.engines) if i not in self.lost]
        for call in [self.manager.shutdown.remote(), *(e.stop.remote() for e in engines)]:
            try:
                ray.get(call, timeout=60)
            except Exception as exc:  # keep stopping the others
                logger.warning("shutdown: %s", exc)
