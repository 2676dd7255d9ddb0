"""Checkpoint conversion, HF <-> Megatron-Core `torch_dist`, with proof on every run.

Both directions run one process per rank of the requested layout: launched here with torchrun
when started plainly, or joining the job when started by torchrun / srun. Every conversion checks
the HF config against the weights (or against the checkpoint's own record) and refuses silent
mismatches; `--verify` also compares HF and Megatron logits on random tokens.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimrl.errors import SlimError
from slimrl.megatron_bridge.archs import arch_from_hf_config
from slimrl.megatron_bridge.checkpoint_meta import check_same_architecture, read_model_meta
from slimrl.megatron_bridge.dist_ckpt import (
    LayerwiseCheckpointReader,
    publish,
    save_model,
    save_model_streaming,
    shared_tmp_dir,
)
from slimrl.megatron_bridge.export import Ownership, iter_hf_tensors
from slimrl.megatron_bridge.hf_io import HFCheckpointReader, ShardWriter, finalize_index
from slimrl.megatron_bridge.layout_args import LayoutArgs
from slimrl.megatron_bridge.loading import (
    ShardContext,
    check_everything_consumed,
    hf_shard_blocks,
    load_hf_into_megatron,
    rules_for,
)
from slimrl.megatron_bridge.megatron_config import BuildOptions
from slimrl.megatron_bridge.safetensors_index import BridgeError
from slimrl.model_arch import ModelArch, read_hf_config
from slimrl.parallel_layout import ParallelLayout
from slimrl.trainer.distributed import RankInfo, init_distributed, use_cuda
from slimrl.trainer.forward import forward_logits
from slimrl.trainer.model import build_gpt_chunks

DEFAULT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
_CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _init(arch: ModelArch, layout_args: LayoutArgs):

    layout = ParallelLayout.resolve(
        layout_args.parallel_config(arch.num_layers), layout_args.world_size, arch
    )
    init_distributed(RankInfo.from_env(), layout, seed=0)
    return layout


def _build(arch: ModelArch, layout, dtype: torch.dtype, meta: bool = False) -> list[Any]:
    """The layout's model chunks; on the meta device when tensors will be streamed instead."""
    import contextlib

    options = BuildOptions(use_te=use_cuda(), params_dtype=dtype, init_weights=False)
    with torch.no_grad(), torch.device("meta") if meta else contextlib.nullcontext():
        chunks = build_gpt_chunks(arch, layout, options, max_seq_len=arch.max_position_embeddings)
    for chunk in chunks:
        chunk.eval()
    return chunks


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _progress(total: int | None, desc: str):
    """Rank 0's bar (on stdout: stderr is kept for the one-line error a failed conversion prints).
    With several ranks it counts rank 0's own share, so it has no total."""
    import torch.distributed as dist
    from tqdm import tqdm

    if dist.get_world_size() > 1:
        total, desc = None, f"{desc} (rank 0 of {dist.get_world_size()})"
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=_rank() != 0,
        file=sys.stdout,
    )


# ------------------------------------------------------------------------------ checks
def checkpoint_dtype(cfg: dict[str, Any], reader: HFCheckpointReader) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if name in _CHECKPOINT_DTYPES:
        return _CHECKPOINT_DTYPES[name]
    return reader.get(reader.names[0]).dtype


def check_weights_match_config(reader: HFCheckpointReader, arch: ModelArch, hf_dir: Path) -> None:
    """Refuse a config.json that does not describe the weights next to it."""
    names = set(reader.names)
    config = hf_dir / "config.json"
    rows = reader.shape("model.embed_tokens.weight")
    if rows[0] != arch.vocab_size or rows[1] != arch.hidden_size:
        raise BridgeError(
            f"{config}: vocab_size={arch.vocab_size}, hidden_size={arch.hidden_size} but "
            f"model.embed_tokens.weight is {list(rows)}"
        )
    has_head = "lm_head.weight" in names
    if not arch.tie_word_embeddings and not has_head:
        raise BridgeError(f"{config}: tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    if layers != set(range(arch.num_layers)):
        raise BridgeError(
            f"{config}: num_hidden_layers={arch.num_layers} but the weights have {len(layers)} layers"
        )
    if arch.is_moe:
        experts = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n}
        if experts != set(range(arch.num_experts or 0)):
            raise BridgeError(
                f"{config}: num_experts={arch.num_experts} but the weights have {len(experts)} experts "
                f"per layer"
            )


# ------------------------------------------------------------------------------ verify
@dataclass(frozen=True)
class VerifyResult:
    max_logit_diff: float
    max_logprob_diff: float
    mean_logprob_diff: float


def verify_against_hf(
    chunks: list[Any], arch: ModelArch, hf_dir: Path, dtype: torch.dtype, num_tokens: int = 64, seed: int = 0
) -> VerifyResult | None:
    """Run HF and Megatron on the same random tokens; the result is on the reporting rank only."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, arch.vocab_size, (2, num_tokens), generator=generator)
    logits = forward_logits(chunks, tokens)
    reporting = logits is not None and mpu.get_tensor_model_parallel_rank() == 0
    reporting = reporting and mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    result = None
    if reporting:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
        with torch.no_grad():
            reference = model(tokens).logits.double()
        ours = logits[..., : arch.vocab_size].double()
        targets = tokens[:, 1:].unsqueeze(-1)
        lp_ours = torch.log_softmax(ours, -1)[:, :-1].gather(-1, targets)
        lp_ref = torch.log_softmax(reference, -1)[:, :-1].gather(-1, targets)
        result = VerifyResult(
            max_logit_diff=(ours - reference).abs().max().item(),
            max_logprob_diff=(lp_ours - lp_ref).abs().max().item(),
            mean_logprob_diff=(lp_ours - lp_ref).abs().mean().item(),
        )
    gathered: list[VerifyResult | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return next(r for r in gathered if r is not None)


# ------------------------------------------------------------------------------ directions
def _refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise BridgeError(f"{out}: output exists; pass --force to replace it")


def hf_to_megatron(
    hf_dir: Path, out: Path, layout_args: LayoutArgs, verify: bool = False, tolerance: float | None = None,
    force: bool = False,
) -> VerifyResult | None:  # fmt: skip
    """All ranks: read the HF checkpoint into the layout's shards, save as torch_dist."""

    hf_dir, out = Path(hf_dir), Path(out)
    _refuse_existing(out, force)
    cfg = read_hf_config(hf_dir)
    arch = arch_from_hf_config(cfg, str(hf_dir / "config.json"))
    reader = HFCheckpointReader(hf_dir)
    check_weights_match_config(reader, arch, hf_dir)
    dtype = checkpoint_dtype(cfg, reader)
    layout = _init(arch, layout_args)
    start = time.perf_counter()
    tmp = shared_tmp_dir(out)
    try:
        result = _write_torch_dist(hf_dir, tmp, cfg, arch, layout, reader, dtype, verify, tolerance)
        publish(tmp, out, overwrite=force)
    finally:
        if _rank() == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _report("hf -> torch_dist", reader.total_bytes(), time.perf_counter() - start)
    return result


def _report(direction: str, nbytes: int, seconds: float) -> None:
    if _rank() == 0:
        print(
            f"{direction}: {nbytes / 1e9:.3f} GB in {seconds:.2f} s ({nbytes / 1e9 / seconds:.3f} GB/s)",
            flush=True,
        )


def _write_torch_dist(
    hf_dir: Path, tmp: Path, cfg: dict[str, Any], arch: ModelArch, layout, reader: HFCheckpointReader,
    dtype: torch.dtype, verify: bool, tolerance: float | None,
) -> VerifyResult | None:  # fmt: skip

    total = sum(reader.nbytes(n) for n in reader.names)
    if verify:  # the forward pass needs the real model
        chunks = _build(arch, layout, dtype)
        with _progress(total, "hf -> torch_dist") as bar:
            load_hf_into_megatron(chunks, arch, layout, str(hf_dir), progress=bar.update)
        result = verify_against_hf(chunks, arch, hf_dir, dtype)
        _enforce_tolerance(result, tolerance if tolerance is not None else DEFAULT_TOLERANCE[dtype])
        save_model(chunks, tmp, cfg, layout)
        return result
    # Stream: the model exists only on the meta device; each shard is built as the writer needs it.
    chunks = _build(arch, layout, dtype, meta=True)
    rules, ctx = rules_for(arch), ShardContext(arch, layout)
    consumed: set[str] = set()
    with _progress(total, "hf -> torch_dist") as bar:

        def produce(local):
            blocks, names = hf_shard_blocks(local, rules, reader, arch, ctx)
            consumed.update(names)
            bar.update(sum(reader.nbytes(n) for n in names))
            return blocks

        save_model_streaming(chunks, tmp, cfg, layout, produce, ctx.expert_offset)
    check_everything_consumed(consumed, set(reader.names), str(hf_dir))
    return None


def _enforce_tolerance(result: VerifyResult, tolerance: float) -> None:
    if _rank() == 0:
        print(
            f"verify: max |logit diff| {result.max_logit_diff:.3e}, per-token logprob diff max "
            f"{result.max_logprob_diff:.3e} mean {result.mean_logprob_diff:.3e} (tolerance {tolerance:.1e})",
            flush=True,
        )
    if result.max_logit_diff > tolerance:
        raise SlimError(  # the conversion failed, not its input (exit 1)
            f"verify failed: max |logit diff| {result.max_logit_diff:.3e} exceeds the tolerance "
            f"{tolerance:.1e}; "
            f"the conversion does not reproduce the HF model"
        )


def megatron_to_hf(
    ckpt: Path, out: Path, hf_config_dir: Path, layout_args: LayoutArgs, force: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:  # fmt: skip
    """All ranks: load torch_dist into the layout's shards, stream HF tensors into shard files."""
    import torch.distributed as dist

    ckpt, out, hf_config_dir = Path(ckpt), Path(out), Path(hf_config_dir)
    _refuse_existing(out, force)
    meta = read_model_meta(ckpt)
    target_cfg = read_hf_config(hf_config_dir)
    check_same_architecture(meta["hf_config"], target_cfg, hf_config_dir / "config.json")
    arch = arch_from_hf_config(target_cfg, str(hf_config_dir / "config.json"))
    dtype = _CHECKPOINT_DTYPES.get(target_cfg.get("dtype") or target_cfg.get("torch_dtype"), torch.float32)
    layout = _init(arch, layout_args)
    start = time.perf_counter()
    # The model exists on the meta device; each rank reads its shards a layer at a time and streams
    # the HF tensors out, so memory holds about one layer.
    chunks = _build(arch, layout, dtype, meta=True)
    ownership = Ownership(chunks, spread=True)  # data-parallel replicas split the tensors
    source = LayerwiseCheckpointReader(chunks, ckpt, ownership.owns)
    tmp = shared_tmp_dir(out)
    try:
        writer = ShardWriter(tmp, rank=_rank(), max_shard_bytes=max_shard_bytes)
        with _progress(None, "torch_dist -> hf") as bar:
            for name, tensor in iter_hf_tensors(chunks, arch, layout, source, ownership):
                writer.add(name, tensor)
                bar.update(tensor.numel() * tensor.element_size())
        writer.flush()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (writer.files, writer.bytes_written))
        if _rank() == 0:
            files = [f for part in gathered for f in part[0]]
            finalize_index(tmp, files, sum(part[1] for part in gathered))
            _copy_config_and_tokenizer(hf_config_dir, tmp)
        publish(tmp, out, overwrite=force)
        total = sum(part[1] for part in gathered)
    finally:
        if _rank() == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _report("torch_dist -> hf", total, time.perf_counter() - start)


_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
_SIDE_FILES += (
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def _copy_config_and_tokenizer(src: Path, dst: Path) -> None:
    for name in _SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
