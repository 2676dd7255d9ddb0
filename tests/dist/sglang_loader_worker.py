"""torchrun worker: SGLang's own model classes load our export's buckets; its checkpoint load is the referee.

Usage: torchrun --nproc-per-node 2 tests/dist/sglang_loader_worker.py OUT_DIR SPEC_JSON
SPEC_JSON: {"cases": {case: hf_dir}, "layouts": {case: {layout: [key=value, ...]}}, "bucket_bytes": [...]}.

Both ranks load each case's HF checkpoint into Megatron under each layout and stream it out through
`export_hf_buckets` at each bucket size (a 1-rank layout runs as two data-parallel replicas, whose
replica 0 owns every tensor). Rank 0 gathers every rank's buckets, both ranks leave the training
process group, and rank 0 referees as a single CPU rank of SGLang (gloo WORLD of 1, TP1): it builds
each case's SGLang model class twice from the same start values; the reference loads the
checkpoint's safetensors in one `load_weights` call, as SGLang's loader does; the other gets one
`load_weights` call per bucket, rank 0's buckets then rank 1's, each rank's in its export order.
OUT_DIR/rank0.json names, per case, layout and bucket size, every parameter, buffer or derived
tensor (DeepSeek's `w_kc`/`w_vc`) that differs; the other ranks write an empty report.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# SGLang builds its CPU model code only with this set, and needs our `sgl_kernel` stand-in first
# on the path (the PyPI kernel wheel loads libcuda): what `slimrl.compat.sglang_cpu.cpu_env` gives
# a CPU server, set before anything imports SGLang.
os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
from slimrl.compat.sglang_cpu import STANDIN_DIR

sys.path.insert(0, str(STANDIN_DIR))

import torch
import torch.distributed as dist

Export = dict[str, Any]
"""One layout's export on one rank: {"tensors": {name: tensor}, "buckets": {size: [[name, ...], ...]}}."""

SGLANG_CLASSES = {
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3",
    "Qwen3MoeForCausalLM": "sglang.srt.models.qwen3_moe",
    "DeepseekV3ForCausalLM": "sglang.srt.models.deepseek_v2",
}


def export_all(spec: dict[str, Any]) -> dict[str, dict[str, Export]]:
    """This rank's buckets per case, layout and bucket size; each tensor is kept once (every bucket
    size must give the same values)."""
    from slimrl.compat import megatron_cpu

    megatron_cpu.apply()  # before Megatron-Core's first import: it compiles ~40 functions on import
    from megatron.core import parallel_state as mpu

    from slimrl.preflight import load_config
    from slimrl.megatron_bridge.export import export_hf_buckets
    from slimrl.megatron_bridge.loading import load_hf_into_megatron
    from slimrl.megatron_bridge.archs import read_model_arch
    from slimrl.trainer.distributed import RankInfo, init_distributed
    from slimrl.trainer.model import build_gpt_chunks, build_options
    from slimrl.parallel_layout import ParallelLayout

    info = RankInfo.from_env()
    out: dict[str, dict[str, Export]] = {}
    for case, hf_dir in spec["cases"].items():
        for layout_name, overrides in spec["layouts"][case].items():
            config = load_config(
                None,
                [f"model.hf_checkpoint={hf_dir}", "cluster.device=cpu",
                 f"cluster.gpus_per_node={info.world_size}", *overrides],
            )  # fmt: skip
            arch = read_model_arch(hf_dir, config.model.overrides)
            layout = ParallelLayout.resolve(config.parallel, info.world_size, arch)
            if not dist.is_initialized():
                init_distributed(info, layout, seed=0)
            else:
                mpu.destroy_model_parallel()
                layout.initialize()
            options = build_options(config, use_cuda=False)  # float32 on CPU: exact copies
            chunks = build_gpt_chunks(arch, layout, options, config.train.max_seq_len)
            load_hf_into_megatron(chunks, arch, layout, hf_dir)
            kept: dict[str, torch.Tensor] = {}
            buckets: dict[int, list[list[str]]] = {}
            for size in spec["bucket_bytes"]:
                buckets[size] = []
                for bucket in export_hf_buckets(chunks, arch, layout, size):
                    for name, tensor in bucket:
                        assert torch.equal(kept.setdefault(name, tensor.detach().clone()), tensor), name
                    buckets[size].append([name for name, _ in bucket])
            out.setdefault(case, {})[layout_name] = {"tensors": kept, "buckets": buckets}
    return out


def sglang_model_factory(hf_dir: str) -> Any:
    """A function building SGLang's own model class for the checkpoint, configured as a CPU server
    of one rank (gloo WORLD of 1, TP1, no attention DP); the first call sets up SGLang's groups."""
    import importlib

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from slimrl.utils.net import free_port

    server_args = ServerArgs(
        model_path=hf_dir, device="cpu", dtype="float32", attention_backend="torch_native"
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    if not dist.is_initialized():
        parallel_state.init_distributed_environment(
            backend="gloo", world_size=1, rank=0, local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )  # fmt: skip
        parallel_state.initialize_model_parallel()
    initialize_dp_attention(server_args)
    config = ModelConfig.from_server_args(server_args).hf_config
    if config.model_type == "deepseek_v3":
        # Keys every DeepSeek-V3 and Moonlight config.json carries (configs/models/) and SGLang's
        # DeepSeek class reads, which transformers 5 does not write for a tiny model.
        for key, value in (("moe_layer_freq", 1), ("topk_method", "noaux_tc")):
            if not hasattr(config, key):
                setattr(config, key, value)
        # SGLang's CPU RoPE for MLA (`rotary_embedding/factory.py::get_rope_cpu`) asserts
        # `rope_scaling is not None` and supports only DeepSeek YaRN; an identity YaRN (factor 1)
        # builds it. RoPE has no weights, so the loaders under test are unaffected.
        rope = dict(config.rope_parameters)
        if rope.get("rope_type", "default") == "default":
            rope.update(rope_type="yarn", factor=1.0,
                        original_max_position_embeddings=config.max_position_embeddings)  # fmt: skip
            config.rope_parameters = rope
    name = config.architectures[0]
    cls = getattr(importlib.import_module(SGLANG_CLASSES[name]), name)
    return lambda: cls(config=config, quant_config=None)


def tensors(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Every tensor a load can write: parameters, buffers and tensors the loader derives and keeps
    as plain attributes (DeepSeek's `w_kc`/`w_vc` from `kv_b_proj`), as (module, attribute)."""
    out: dict[str, tuple[torch.nn.Module, str]] = {}
    for prefix, module in model.named_modules():
        names = [k for k, v in (*module._parameters.items(), *module._buffers.items()) if v is not None]
        names += [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) or k in ("w_kc", "w_vc")]
        for attr in names:
            out[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    return out


def read(slot: tuple[torch.nn.Module, str]) -> torch.Tensor | None:
    return getattr(*slot)


class StartState:
    """The same start values for every instance: seeded noise in each floating-point parameter and
    buffer (so nothing is equal by accident), derived attributes as the constructor left them."""

    def __init__(self, model: torch.nn.Module) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.values: dict[str, Any] = {}
        for name, slot in tensors(model).items():
            value = read(slot)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and attr_kind(slot) != "derived":
                value = torch.randn(value.shape, generator=generator).to(value.dtype)
            self.values[name] = value.clone() if isinstance(value, torch.Tensor) else value

    def apply(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, slot in tensors(model).items():
                value = self.values[name]
                if attr_kind(slot) == "derived":
                    setattr(*slot, value.clone() if isinstance(value, torch.Tensor) else value)
                else:
                    read(slot).copy_(value)


def attr_kind(slot: tuple[torch.nn.Module, str]) -> str:
    module, attr = slot
    return "param" if attr in module._parameters else "buffer" if attr in module._buffers else "derived"


def differences(reference: torch.nn.Module, model: torch.nn.Module) -> list[str]:
    ours = tensors(model)
    out = []
    for name, slot in tensors(reference).items():
        want, got = read(slot), read(ours[name])
        same = (want is None and got is None) or (
            isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
            and want.dtype == got.dtype and want.shape == got.shape and torch.equal(want, got)
        )  # fmt: skip
        if not same:
            out.append(name)
    return out


def referee(spec: dict[str, Any], exports: dict[str, dict[str, list[Export]]]) -> dict[str, Any]:
    """For each case in `exports` (every rank's export of each layout): the parameters the reference
    load left at their start values (none may be: the comparison would prove nothing for them), and
    per layout and bucket size the buckets sent and the tensors that differ from the reference."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    report: dict[str, Any] = {}
    for case, layouts in exports.items():
        hf_dir = spec["cases"][case]
        build = sglang_model_factory(hf_dir)
        reference, model = build(), build()
        start = StartState(reference)
        start.apply(reference)
        files = sorted(str(f) for f in Path(hf_dir).glob("*.safetensors"))
        reference.load_weights(safetensors_weights_iterator(files))
        untouched = [
            name for name, slot in tensors(reference).items()
            if attr_kind(slot) == "param" and torch.equal(read(slot), start.values[name])
        ]  # fmt: skip
        runs: dict[str, Any] = {}
        for layout, per_rank in layouts.items():
            values = {name: t for export in per_rank for name, t in export["tensors"].items()}
            for size in spec["bucket_bytes"]:
                start.apply(model)
                sent = [bucket for export in per_rank for bucket in export["buckets"][size]]
                for bucket in sent:  # every owner's buckets reach the same engine, one call each
                    model.load_weights([(name, values[name]) for name in bucket])
                differ = differences(reference, model)
                runs.setdefault(layout, {})[str(size)] = {"differ": differ, "buckets": sent}
        checkpoint = sorted(n for n, _ in safetensors_weights_iterator(files))
        compared = list(tensors(reference))
        report[case] = {"untouched": untouched, "runs": runs, "checkpoint": checkpoint, "compared": compared}
    return report


def main() -> None:
    out_dir, spec = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    mine = export_all(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    from slimrl.trainer.distributed import destroy_distributed

    destroy_distributed()  # rank 0 now becomes a single-rank SGLang (its own gloo WORLD of 1)
    report: dict[str, Any] = {}
    if gathered is not None:  # one referee: a second would cost its own ~10 s SGLang import
        exports = {case: {layout: [g[case][layout] for g in gathered] for layout in layouts}
                   for case, layouts in spec["layouts"].items()}  # fmt: skip
        report = referee(spec, exports)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
