"""Trainer configuration plumbing that only matters on GPUs, checked on CPU: optimizer CPU offload,
FP8 recipes; and frozen parameters on a real RL step.

FP8 on CPU is refused by the config checks (`parallel.fp8=blockwise` case in tests/test_config.py).
"""

from __future__ import annotations

import pytest
import torch

from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.megatron_bridge.megatron_config import BuildOptions, transformer_config_kwargs
from slimrl.parallel_layout import ParallelLayout
from slimrl.preflight import load_config
from slimrl.trainer.model import optimizer_config_kwargs
from tests.conftest import REPO, run_torchrun

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
GPU_OPTIONS = BuildOptions(use_te=True, params_dtype=torch.bfloat16)


def _config(tiny_model, *overrides: str):
    return load_config(
        None, [f"model.hf_checkpoint={tiny_model('qwen3_moe')}", "cluster.gpus_per_node=1", *overrides]
    )


def _optimizer_config_fields() -> set[str]:
    from dataclasses import fields

    from megatron.core.optimizer import OptimizerConfig

    return {f.name for f in fields(OptimizerConfig)}


def test_optimizer_cpu_offload_on_gpu_offloads_everything(tiny_model):
    config = _config(
        tiny_model, "train.optimizer.cpu_offload=true", "parallel.use_distributed_optimizer=true"
    )
    kwargs = optimizer_config_kwargs(config, GPU_OPTIONS, use_cuda=True)
    assert kwargs["optimizer_cpu_offload"] is True
    assert kwargs["optimizer_offload_fraction"] == 1.0  # megatron-core's default 0.0 offloads nothing
    assert kwargs["use_precision_aware_optimizer"] is True  # as Megatron-LM pairs them
    assert kwargs["use_distributed_optimizer"] is True and kwargs["bf16"] is True
    assert set(kwargs) <= _optimizer_config_fields()  # megatron-core's names (cannot build without TE)


def test_optimizer_cpu_offload_without_the_distributed_optimizer_is_refused_at_load(tiny_model):
    with pytest.raises(ConfigError, match=r"parallel\.use_distributed_optimizer=true"):
        _config(tiny_model, "train.optimizer.cpu_offload=true", "parallel.use_distributed_optimizer=false")


def test_optimizer_cpu_offload_is_a_no_op_on_cpu(tiny_model):
    from megatron.core.optimizer import OptimizerConfig

    options = BuildOptions(use_te=False)
    with_offload = optimizer_config_kwargs(
        _config(tiny_model, "train.optimizer.cpu_offload=true"), options, use_cuda=False
    )
    assert with_offload == optimizer_config_kwargs(_config(tiny_model), options, use_cuda=False)
    assert "optimizer_cpu_offload" not in with_offload
    assert OptimizerConfig(**with_offload).optimizer_cpu_offload is False  # builds as is


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_recipe_reaches_the_transformer_config(tiny_model, recipe):
    # megatron-core refuses to build an FP8 TransformerConfig without Transformer Engine, so the
    # constructor arguments are checked.
    arch = read_model_arch(str(tiny_model("qwen3_moe")), None)
    layout = ParallelLayout.resolve(_config(tiny_model).parallel, 1, arch)
    kwargs = transformer_config_kwargs(arch, layout, BuildOptions(use_te=True, fp8_recipe=recipe))
    assert kwargs["fp8"] == "e4m3" and kwargs["fp8_recipe"] == recipe
    assert kwargs["moe_grouped_gemm"] is True  # the TE path
    plain = transformer_config_kwargs(arch, layout, BuildOptions(use_te=True))
    assert "fp8" not in plain and "fp8_recipe" not in plain


@pytest.mark.parametrize("use_te", [False, True], ids=["cpu", "gpu"])
def test_virtual_pipeline_uses_unbatched_p2p(tiny_model, use_te):
    # The interleaved schedule sends an activation and a gradient to the same peer in one call at
    # pp=2; batched isend/irecv matches them per peer in posting order and swapped the two.
    model = tiny_model("qwen3_moe", num_hidden_layers=4)
    arch = read_model_arch(str(model), None)

    def kwargs(*overrides: str) -> dict:
        config = load_config(None, [f"model.hf_checkpoint={model}", "cluster.gpus_per_node=2", *overrides])
        layout = ParallelLayout.resolve(config.parallel, 2, arch)
        return transformer_config_kwargs(arch, layout, BuildOptions(use_te=use_te))

    interleaved = kwargs("parallel.pp=2", "parallel.vpp=2")
    assert interleaved["batch_p2p_comm"] is False
    assert interleaved["virtual_pipeline_model_parallel_size"] == 2
    assert kwargs("parallel.pp=2")["batch_p2p_comm"] is True  # 1F1B never sends both ways in one call


@pytest.mark.slow
def test_frozen_parameters_do_not_move(tmp_path, tiny_model):
    (result,) = run_torchrun(
        REPO / "tests" / "dist" / "frozen_worker.py",
        1,
        [
            f"model.hf_checkpoint={tiny_model('qwen3_moe')}",
            "cluster.gpus_per_node=1",
            "train.frozen_params=['*.router.*']",
            "train.optimizer.lr=1e-3",
            "train.optimizer.cpu_offload=true",  # a no-op on CPU: the step must still work
        ],
        tmp_path,
    )
    routers = sorted(n for n in result["requires_grad"] if ".router." in n)
    assert routers and result["frozen"] == len(routers)
    assert result["unchanged"] == routers  # bitwise equal after the step; everything else moved
    assert not any(result["requires_grad"][n] for n in routers)
    assert "HybridDeviceOptimizer" not in result["optimizers"]


def test_the_rank_api_is_what_the_megatron_actor_implements_and_all_the_group_calls():
    """`TrainerRank` (the driver's seam to a rank) and `MegatronActor` agree method for method and
    parameter for parameter, and the group names no rank method outside it (nor any by a string)."""
    import ast
    import inspect

    from slimrl.orchestration import trainer_group
    from slimrl.trainer.actor import MegatronActor
    from slimrl.trainer.rank_api import TrainerRank

    api = {name for name, _ in inspect.getmembers(TrainerRank, inspect.isfunction) if name[0] != "_"}
    assert api >= {"setup", "train_rl", "push_weights", "save_checkpoint", "load_checkpoint", "offload"}
    for name in api:
        ours = inspect.signature(getattr(TrainerRank, name)).parameters.values()
        theirs = inspect.signature(getattr(MegatronActor, name)).parameters.values()
        assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in theirs], name
    nodes = list(ast.walk(ast.parse(inspect.getsource(trainer_group))))
    named = {
        node.attr for node in nodes
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "TrainerRank"
    }  # fmt: skip
    by_string = [
        node.args[0].value for node in nodes
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("run", "remote") and node.args and isinstance(node.args[0], ast.Constant)
    ]  # fmt: skip
    assert named and named <= api and by_string == [], (named, by_string)
