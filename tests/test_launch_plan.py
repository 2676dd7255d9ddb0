"""Placement and GPU visibility without GPUs: the seats, environment and launch arguments every
engine and training rank gets on a simulated 2-node x 8-GPU layout, Ray's own behaviour with fake
GPU resources, the weight-sync choice, and `slimrl train --dry-run` on every shipped config."""

from __future__ import annotations

from pathlib import Path

import pytest

from slimrl.config.schema import SlimConfig
from slimrl.devices.launch_plan import (
    NOSET_CUDA_VISIBLE_DEVICES,
    Slot,
    engine_base_gpu_id,
    engine_seats,
    order_slots,
    simulated_layout,
    trainer_seats,
)
from slimrl.errors import ConfigError, SlimError
from slimrl.orchestration.dry_run import engine_launches, render
from slimrl.orchestration.placement import node_labels
from slimrl.preflight import load_config
from slimrl.preflight.finalize import weight_transport
from tests.conftest import REPO, run_slimrl

GPU_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if "configs/models/" in p.read_text())


def two_by_eight(colocate: bool, engines: int, tp: int, rollout_gpus: int = 0) -> SlimConfig:
    config = SlimConfig()
    config.cluster.num_nodes, config.cluster.gpus_per_node, config.cluster.device = 2, 8, "cuda"
    config.cluster.colocate, config.cluster.rollout_gpus = colocate, rollout_gpus
    config.rollout.engine, config.rollout.num_engines, config.rollout.gpus_per_engine = "sglang", engines, tp
    config.rollout.sglang.ep_size = 1
    return config


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("colocate", "engines", "tp", "rollout_gpus", "expected"),
    [
        # (node, GPUs, --base-gpu-id) per engine
        (True, 2, 8, 0, [("node0", range(0, 8), 0), ("node1", range(0, 8), 0)]),
        (True, 4, 4, 0, [("node0", range(0, 4), 0), ("node0", range(4, 8), 4),
                         ("node1", range(0, 4), 0), ("node1", range(4, 8), 4)]),
        (False, 1, 8, 8, [("node1", range(0, 8), 0)]),
        (False, 2, 4, 8, [("node1", range(0, 4), 0), ("node1", range(4, 8), 4)]),
        (False, 2, 2, 4, [("node1", range(4, 6), 4), ("node1", range(6, 8), 6)]),
    ],
)  # fmt: skip
def test_engines_see_their_node_and_start_at_their_first_gpu(colocate, engines, tp, rollout_gpus, expected):
    config = two_by_eight(colocate, engines, tp, rollout_gpus)
    launches = engine_launches(config, "cuda")
    assert len(launches) == len(expected)
    for launch, (node, gpus, base) in zip(launches, expected, strict=True):
        assert (launch.seat.node, launch.seat.devices) == (node, tuple(gpus))
        assert launch.env[NOSET_CUDA_VISIBLE_DEVICES] == "1" and "CUDA_VISIBLE_DEVICES" not in launch.env
        argv = launch.command
        assert flag(argv, "--base-gpu-id") == str(base) and flag(argv, "--tp-size") == str(tp)
        assert flag(argv, "--host") == node and "--device" not in argv
        assert ("--enable-memory-saver" in argv) == colocate


def test_trainer_ranks_get_one_known_gpu_each():
    config = two_by_eight(colocate=False, engines=1, tp=8, rollout_gpus=8)
    seats = trainer_seats(config, simulated_layout(config), "cuda")
    assert [(s.rank, s.node, s.device, s.visible_devices) for s in seats] == [
        (r, "node0", r, str(r)) for r in range(8)
    ]
    colocated = two_by_eight(colocate=True, engines=2, tp=8)
    seats = trainer_seats(colocated, simulated_layout(colocated), "cuda")
    assert [(s.node, s.device) for s in seats[7:10]] == [("node0", 7), ("node1", 0), ("node1", 1)]
    assert trainer_seats(colocated, simulated_layout(colocated), "cpu")[0].visible_devices is None


def test_cpu_engines_get_no_gpu_switch_or_flag():
    config = two_by_eight(colocate=True, engines=2, tp=8)
    config.cluster.device = "cpu"
    for launch in engine_launches(config, "cpu"):
        assert NOSET_CUDA_VISIBLE_DEVICES not in launch.env and not launch.seat.on_gpu
        assert "--base-gpu-id" not in launch.command and flag(launch.command, "--device") == "cpu"
        assert launch.env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_base_gpu_id_follows_an_inherited_visible_list():
    assert engine_base_gpu_id((4, 5, 6, 7)) == 4
    assert engine_base_gpu_id((6, 7), "4,5,6,7") == 2  # e.g. Slurm gave the node GPUs 4-7
    with pytest.raises(SlimError, match="not in CUDA_VISIBLE_DEVICES"):
        engine_base_gpu_id((2, 3), "4,5,6,7")
    with pytest.raises(SlimError, match="not consecutive"):
        engine_base_gpu_id((4, 6))
    with pytest.raises(SlimError, match="not consecutive"):
        engine_base_gpu_id((4, 5), "5,4")


def test_bundles_sort_by_node_then_device():
    probed = [("10.0.0.2", 1), ("10.0.0.1", 1), ("10.0.0.2", 0), ("10.0.0.1", 0)]
    order, layout = order_slots(probed, use_gpu=True)
    assert order == [3, 1, 2, 0]
    assert layout == [Slot("10.0.0.1", 0), Slot("10.0.0.1", 1), Slot("10.0.0.2", 0), Slot("10.0.0.2", 1)]
    _, cpu = order_slots([("a", 0), ("b", 0), ("a", 0)], use_gpu=False)  # CPU bundles: positions
    assert cpu == [Slot("a", 0), Slot("a", 1), Slot("b", 0)]
    labels = node_labels([("1.1.1.1", "aaaaaaaaaa", 0), ("1.1.1.1", "bbbbbbbbbb", 0), ("2.2.2.2", "c", 3)])
    assert labels == [("1.1.1.1/aaaaaaaa", 0), ("1.1.1.1/bbbbbbbb", 0), ("2.2.2.2", 3)]


def test_engine_spanning_nodes_is_caught():
    config = two_by_eight(colocate=False, engines=1, tp=8, rollout_gpus=12)  # slots 4..11
    with pytest.raises(SlimError, match="span nodes"):
        engine_seats(config, simulated_layout(config), "cuda")


# ---------------------------------------------------------------- weight sync choice and checks


def test_auto_weight_sync_never_picks_what_the_layout_cannot_run():
    config = two_by_eight(colocate=True, engines=2, tp=8)
    assert weight_transport(config) == "tensor"  # colocated on two hosts: references per node
    config.cluster.num_nodes = 1
    config.rollout.num_engines = 1
    assert weight_transport(config) == "tensor"
    config.cluster.colocate = False
    assert weight_transport(config) == "distributed"
    config.rollout.weight_sync = "disk"
    assert weight_transport(config) == "disk"


def _tiny_2x4(tiny: Path, *extra: str) -> list[str]:
    return [
        f"model.hf_checkpoint={tiny}", "cluster.device=cpu", "cluster.num_nodes=2", "cluster.gpus_per_node=4",
        "rollout.rollout_batch_size=8", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["cluster.colocate=false", "cluster.rollout_gpus=4", "rollout.weight_sync=tensor"],
         "engine/0/tp0 on node1 slot 0 has no trainer rank on its node"),
        (["rollout.weight_sync=distributed"],
         "trainer/0 and engine/0/tp0 are both on node0 slot 0 in the weight_sync group"),
        (["cluster.colocate=false", "cluster.rollout_gpus=6", "rollout.gpus_per_engine=4"],
         "rollout.gpus_per_engine=4: engine 0 would take devices 2..5, across two nodes"),
    ],
)  # fmt: skip
def test_layouts_the_transports_cannot_serve_are_refused(tiny_model, extra, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, _tiny_2x4(tiny_model("qwen3_moe"), *extra))
    ok = load_config(None, _tiny_2x4(tiny_model("qwen3_moe"), "rollout.weight_sync=tensor"))
    assert weight_transport(ok) == "tensor"  # colocated on two hosts: each rank's own slot


def test_cli_refuses_a_shared_device_in_a_group_with_exit_2(tiny_model, mod_sum_data):
    overrides = _tiny_2x4(
        tiny_model("qwen3_moe"), "rollout.weight_sync=distributed", f"data.prompt_data={mod_sum_data}"
    )
    proc = run_slimrl("train", "configs/tiny_moe_grpo_cpu.yaml", *overrides, "--dry-run")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "NCCL" in lines[0] and "rollout.weight_sync=tensor" in lines[0]


# ---------------------------------------------------------------- dry run


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_gpu_config_dry_runs(path, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(path)
    report = render(config)
    assert "nothing is started" in report and "device cuda" in report
    assert "weight sync: tensor (auto)" in report  # colocated, on any number of nodes
    assert report.count("sglang.launch_server") == config.rollout.num_engines
    assert report.count(f"env {NOSET_CUDA_VISIBLE_DEVICES}=1") == config.rollout.num_engines
    for launch in engine_launches(config, "cuda"):
        assert launch.seat.node == f"node{launch.seat.slots[0] // config.cluster.gpus_per_node}"


def test_dry_run_cli_starts_nothing_and_exits_0():
    proc = run_slimrl("train", "configs/grpo_moe_256gpu.yaml", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "engine 31 on node31 GPUs 0-7" in proc.stdout and "--base-gpu-id 0" in proc.stdout
    assert "ray" not in proc.stderr.lower()


# ---------------------------------------------------------------- Ray with fake GPU resources


@pytest.mark.slow
def test_ray_leaves_engine_actors_the_node_and_gives_ranks_one_gpu(tmp_path):
    """Ray on this CPU machine with 8 fake GPUs: the engine actors' options (the same call as the
    Fleet's) keep CUDA_VISIBLE_DEVICES unset, and a rank's share of one bundle narrows it to that
    bundle's GPU."""
    import os

    import ray

    from slimrl.orchestration.placement import create_device_slots, engine_actor_options, worker_env
    from slimrl.orchestration.rollout_manager import EngineActor

    class ProbedEngine(EngineActor):
        def visible(self) -> tuple[str | None, str | None, list[int]]:
            env = os.environ
            return env.get("CUDA_VISIBLE_DEVICES"), env.get("TOKENIZERS_PARALLELISM"), ray.get_gpu_ids()

    def rank_visible() -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    config = two_by_eight(colocate=False, engines=2, tp=2, rollout_gpus=4)
    config.cluster.num_nodes = 1
    env = {"env_vars": worker_env("cuda")}
    ray.init(address="local", num_cpus=10, num_gpus=8, include_dashboard=False, runtime_env=env)
    try:
        slots = create_device_slots(8, use_gpu=True)
        assert [s.device for s in slots.layout] == list(range(8)) and len({s.node for s in slots.layout}) == 1
        seats = engine_seats(config, slots.layout, "cuda")
        engines = [
            ray.remote(ProbedEngine)
            .options(**engine_actor_options(slots, seat, 1.0))
            .remote(config, seat.index, str(tmp_path), seat)
            for seat in seats
        ]
        for engine, seat in zip(engines, seats, strict=True):
            visible, job_env, gpu_ids = ray.get(engine.visible.remote())
            assert visible is None and job_env == "false"  # Ray's switch off; job env merged in
            assert gpu_ids == [seat.devices[0]]  # Ray still accounts for the slot it reserved
            assert ray.get(engine.base_gpu_id.remote()) == seat.devices[0] == 4 + 2 * seat.index
        probe = ray.remote(rank_visible)
        ranks = [
            probe.options(scheduling_strategy=slots.strategy(r), **slots.resources(0.5)).remote()
            for r in range(4)
        ]
        assert ray.get(ranks) == [str(s.visible_devices) for s in trainer_seats(config, slots.layout, "cuda")]
    finally:
        ray.shutdown()
