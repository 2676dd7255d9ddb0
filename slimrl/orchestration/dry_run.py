"""`slimrl train CONFIG --dry-run`: what a run would start, where, and how, without starting it.

Prints the placement (node and device of every training rank and engine), the weight-sync
transport and each engine's launch command and environment, from the same functions the Ray
actors use (`launch_plan`, `server_command`). No Ray, no processes: it runs on a laptop for a
256-GPU config, with the config's device taken as given.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.devices.device import resolve_device
from slimrl.devices.launch_plan import (
    EngineSeat,
    TrainerSeat,
    engine_seats,
    simulated_layout,
    trainer_seats,
)
from slimrl.devices.ledger import Ledger, build_ledger
from slimrl.devices.rank_groups import Sizes
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.orchestration.fp8_start import serving_path
from slimrl.orchestration.placement import trainer_env, worker_env
from slimrl.parallel_layout import ParallelLayout
from slimrl.preflight.finalize import weight_transport

PLAN_PORT = 30000
"""Engine i is shown on port PLAN_PORT + i; a real run picks free ports when engines start."""


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """One engine as it would start: its seat, command line and full extra environment."""

    seat: EngineSeat
    command: list[str]
    env: dict[str, str]


def engine_launches(config: SlimConfig, device: str) -> list[EngineLaunch]:
    """Every engine's launch on the config's layout (hosts named `nodeN`, as the plan prints)."""
    from slimrl.rollout.servers import server_command

    model_path = serving_path(config)  # what the engines load: the FP8 start copy for an FP8 fleet
    launches = []
    for seat in engine_seats(config, simulated_layout(config), device):
        host = "127.0.0.1" if config.cluster.num_nodes == 1 and config.ray.address is None else seat.node
        base = seat.base_gpu_id() if seat.on_gpu else None
        cmd, server_env = server_command(config, model_path, host, PLAN_PORT + seat.index, seat.index, base)
        env = {**worker_env(device), **seat.actor_env, **server_env}
        launches.append(EngineLaunch(seat, cmd, env))
    return launches


def trainer_launch_env(config: SlimConfig, device: str) -> dict[str, str]:
    """The extra environment every trainer rank starts with (job-wide `worker_env` + `trainer_env`)."""

    return {**worker_env(device), **trainer_env(config, device)}


def _span(values: list[int]) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])


def _trainer_lines(config: SlimConfig, seats: list[TrainerSeat], device: str) -> list[str]:
    unit = "GPUs" if device == "cuda" else "CPU slots"
    sees = " (Ray sets CUDA_VISIBLE_DEVICES to the rank's one GPU)" if device == "cuda" else ""
    lines = [f"training: {len(seats)} ranks{sees}"]
    for node in dict.fromkeys(s.node for s in seats):
        on_node = [s for s in seats if s.node == node]
        ranks, devices = [s.rank for s in on_node], [s.device for s in on_node]
        lines.append(f"  {node}: ranks {_span(ranks)} on {unit} {_span(devices)}")
    lines += [f"  env {key}={value}" for key, value in sorted(trainer_launch_env(config, device).items())]
    return lines


def _transport_line(config: SlimConfig, device: str) -> str:
    transport = weight_transport(config)
    how = {
        "tensor": "CUDA IPC handles" if device == "cuda" else "shared-memory files",
        "distributed": f"broadcast group over {'NCCL' if device == 'cuda' else 'gloo'}",
        "disk": f"safetensors under {config.run.runs_dir}/{config.run.name}/weight_sync",
    }[transport]
    chosen = " (auto)" if config.rollout.weight_sync == "auto" else ""
    shared = (
        " (must be a directory every node shares)"
        if transport == "disk" and config.cluster.num_nodes > 1
        else ""
    )
    return f"weight sync: {transport}{chosen}: {how}{shared}"


def start_checkpoint(config: SlimConfig) -> dict[str, str] | None:
    """The FP8 start checkpoint an FP8 fleet loads: where, from what, when and how it is written."""
    if config.rollout.sglang.quantization != "fp8":
        return None

    return {
        "path": serving_path(config),
        "from": config.model.hf_checkpoint,
        "written": "at start, before the engines load; reused by restarted engines and resumed runs",
        "how": "block-FP8 copy (weight_sync/fp8.py), the source's safetensors files split among Ray "
        "tasks on the training slots' nodes, written aside and renamed",
    }


def _start_checkpoint_lines(config: SlimConfig) -> list[str]:
    start = start_checkpoint(config)
    if start is None:
        return []
    return [
        f"fp8 start checkpoint: {start['path']} (every engine's --model-path)",
        f"  from {start['from']}",
        f"  written {start['written']}",
        f"  {start['how']}",
    ]


def _engine_lines(launch: EngineLaunch, device: str) -> list[str]:
    seat = launch.seat
    unit = "GPUs" if device == "cuda" else "CPU slots"
    lines = [f"  engine {seat.index} on {seat.node} {unit} {_span(list(seat.devices))}"]
    lines += [f"    env {key}={value}" for key, value in sorted(launch.env.items())]
    lines.append(f"    $ {shlex.join(launch.command)}")
    return lines


def render(config: SlimConfig) -> str:
    """The dry run's report."""
    device = resolve_device(config)
    cluster, rollout = config.cluster, config.rollout
    unit = "GPUs" if device == "cuda" else "CPU slots"
    mode = "colocated" if cluster.colocate else f"disaggregated ({cluster.rollout_gpus} {unit} for rollout)"
    lines = [
        f"dry run of {config.run.name}: nothing is started",
        f"device {device}: {cluster.num_nodes} node(s) x {cluster.gpus_per_node} {unit}, {mode}",
        *_trainer_lines(config, trainer_seats(config, simulated_layout(config), device), device),
    ]
    if config.algorithm.loss == "sft":
        return "\n".join([*lines, "engines: none (algorithm.loss=sft)"])
    lines += [
        _transport_line(config, device),
        f"engines: {rollout.num_engines} x {rollout.gpus_per_engine} {unit} ({rollout.engine}), "
        f"from slot {config.engine_first_slot()}; ports are picked when they start (shown from {PLAN_PORT})",
    ]
    if device == "cuda" and rollout.engine == "sglang":
        lines.append("  engine actors see all GPUs of their node; --base-gpu-id picks their first")
    lines += _start_checkpoint_lines(config)
    for launch in engine_launches(config, device):
        lines += _engine_lines(launch, device)
    return "\n".join(lines)


def config_ledger(config: SlimConfig) -> Ledger:
    """The device ledger of the config's own layout (nodes `node0..`, stand-in GPU UUIDs)."""

    device = resolve_device(config)
    arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
    layout = ParallelLayout.resolve(config.parallel, config.train_world_size(), arch)
    transport = weight_transport(config) if config.algorithm.loss == "policy" else None
    return build_ledger(config, simulated_layout(config), device, Sizes.of(layout), transport)


def render_json(config: SlimConfig) -> dict[str, Any]:
    """`--dry-run --json`: the device ledger, the trainer ranks' environment, and each engine's
    launch (command, environment)."""
    device = resolve_device(config)
    report = config_ledger(config).to_json()
    report["trainer_env"] = trainer_launch_env(config, device)
    if config.algorithm.loss == "policy":
        if (start := start_checkpoint(config)) is not None:
            report["fp8_start"] = start
        report["engines"] = [
            {"index": launch.seat.index, "node": launch.seat.node, "gpus": list(launch.seat.devices),
             "command": launch.command, "env": launch.env}
            for launch in engine_launches(config, device)
        ]  # fmt: skip
    return report
