"""Tiny random Hugging Face checkpoints of every supported architecture, built offline.

They exist so conversion, parallel layouts and the RL loop can be tested on a CPU in seconds with
real transformers classes and real config.json files. The same seed gives byte-identical
weights, so two runs (or two tests) can compare tensors exactly.
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any

from slimrl.data.tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE, build_char_tokenizer
from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import ARCH_SPECS
from slimrl.utils.fs import atomic_directory, atomic_write_text
from slimrl.utils.hf import quiet_progress_bars

TINY_ARCHS: tuple[str, ...] = ("qwen3_moe", "qwen3", "qwen2", "llama", "deepseek_v3")

VOCAB_MULTIPLE = 8
"""Megatron shards the embedding and output layer by rows across tensor-parallel ranks, so the
vocabulary must divide by the TP size; a multiple of 8 allows TP 1, 2, 4 and 8 without padding."""

ROPE_THETA = 10000.0

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
    "initializer_range": 0.02,
    "pad_token_id": PAD_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "bos_token_id": None,
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    # Qwen3MoeConfig has no head_dim field but its attention reads one; real checkpoints carry it.
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    "qwen3": {"head_dim": 16, "tie_word_embeddings": False},
    # Qwen2 always has q/k/v biases (no config key); small Qwen2 models tie their embeddings.
    "qwen2": {"tie_word_embeddings": True},
    "llama": {"head_dim": 16, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
    # MLA has no grouped KV heads, so num_key_value_heads = num_attention_heads as in real V3 configs;
    # transformers derives head_dim (= qk_rope_head_dim) itself. No MTP layers: HF never builds them.
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid",
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
    },
}

_RESERVED_KEYS = frozenset({"model_type", "architectures", "transformers_version", "_name_or_path", "dtype"})
"""Keys make_tiny owns: overriding them would write a checkpoint that lies about itself."""

_SAVED_KEY_RENAMES: dict[str, dict[str, str]] = {"qwen3_moe": {"num_local_experts": "num_experts"}}
"""transformers 5 saves some attribute_map aliases under the internal name; real hub checkpoints (and
slimrl's arch readers) use the public one, and transformers reads either."""


def padded_vocab_size(size: int = VOCAB_SIZE, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-size // multiple) * multiple


def config_class(arch: str) -> type:
    """The transformers config class of `arch` (imported lazily: transformers is slow to import)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[arch]


def default_config_dict(arch: str) -> dict[str, Any]:
    """The config kwargs make_tiny uses for `arch` before overrides."""
    _check_arch(arch)
    return {
        **copy.deepcopy(_COMMON),
        "vocab_size": padded_vocab_size(),
        **copy.deepcopy(_ARCH_DEFAULTS[arch]),
    }


def _check_arch(arch: str) -> None:
    if arch not in TINY_ARCHS:
        raise ConfigError(f"make-tiny: unknown arch `{arch}` (valid: {', '.join(TINY_ARCHS)})")


def _allowed_override_keys(arch: str, defaults: dict[str, Any]) -> set[str]:
    """Keys the config class knows (fields, aliases, what it serializes) plus make_tiny's own defaults."""
    cls = config_class(arch)
    keys = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {})) | set(defaults) | {"rope_theta"}
    return keys - _RESERVED_KEYS


def _apply_overrides(arch: str, defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    allowed = _allowed_override_keys(arch, defaults)
    for key in overrides:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise ConfigError(
                f"make-tiny --set {key}: not a {config_class(arch).__name__} key; {hint}"
                f"valid: {', '.join(sorted(allowed))}"
            )
    merged = {**defaults, **copy.deepcopy(overrides)}
    if "rope_theta" in merged:  # the pre-transformers-5 spelling: fold it into rope_parameters
        merged["rope_parameters"] = {
            **merged["rope_parameters"],
            "rope_theta": float(merged.pop("rope_theta")),
        }
    if merged["vocab_size"] < VOCAB_SIZE:
        raise ConfigError(
            f"make-tiny --set vocab_size={merged['vocab_size']}: must be >= {VOCAB_SIZE} (tokenizer)"
        )
    if arch == "deepseek_v3" and merged.get("scoring_func") != "sigmoid":
        raise ConfigError(
            f"make-tiny --set scoring_func={merged.get('scoring_func')}: DeepSeek-V3 uses `sigmoid`"
        )
    return merged


def build_config(arch: str, overrides: dict[str, Any] | None = None) -> Any:
    """The transformers config for a tiny `arch`; bad override values become a one-line ConfigError."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    kwargs = _apply_overrides(arch, default_config_dict(arch), overrides or {})
    try:
        config = config_class(arch)(**kwargs)
        config.architectures = [_architecture_name(arch)]
    except (TypeError, ValueError, StrictDataclassFieldValidationError) as exc:
        # transformers 5 validates config fields strictly, with a multi-line message: fold it.
        raise ConfigError(f"make-tiny {arch}: invalid config ({' '.join(str(exc).split())})") from None
    return config


def _architecture_name(arch: str) -> str:

    return ARCH_SPECS[arch].hf_architecture


def build_model(arch: str, *, seed: int = 0, overrides: dict[str, Any] | None = None) -> Any:
    """A float32 random model; weights depend on `seed` only (initialisation runs on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(arch, overrides)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # sizes that do not fit together (heads vs KV heads, top-k > experts) fail here
            model(torch.tensor([[PAD_TOKEN_ID, EOS_TOKEN_ID]]))
    except (RuntimeError, ValueError, AssertionError, IndexError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"make-tiny {arch}: these sizes do not make a working model ({message})") from None
    _perturb_constant_tensors(model, seed)
    model.generation_config = _generation_config()
    return model


def _perturb_constant_tensors(model: Any, seed: int, scale: float = 0.02) -> None:
    """Add seeded noise to tensors transformers initialises to a constant (norm weights 1, biases 0).

    Otherwise a checkpoint conversion that swaps two norms or drops a bias would still round-trip
    exactly, and the tests built on these checkpoints could not catch it.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for _, tensor in sorted(model.state_dict().items()):
            if tensor.data_ptr() in seen or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            seen.add(tensor.data_ptr())
            if bool(torch.all(tensor == tensor.flatten()[0])):
                tensor.add_(scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def _generation_config() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, bos_token_id=None)


def _rename_saved_keys(arch: str, config_path: Path) -> None:
    renames = _SAVED_KEY_RENAMES.get(arch)
    if not renames:
        return
    cfg = json.loads(config_path.read_text())
    renamed = {renames.get(key, key): value for key, value in cfg.items()}
    atomic_write_text(config_path, json.dumps(dict(sorted(renamed.items())), indent=2) + "\n")


def make_tiny(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the char tokenizer."""
    _check_arch(arch)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"make-tiny --out {out_dir}: exists and is not a directory")
    if out_dir.exists() and not force:
        raise ConfigError(f"make-tiny --out {out_dir}: exists; pass --force to replace")
    model = build_model(arch, seed=seed, overrides=overrides)  # validate before touching the disk
    try:
        with atomic_directory(out_dir, overwrite=force) as tmp, quiet_progress_bars():
            model.save_pretrained(tmp, safe_serialization=True)
            _rename_saved_keys(arch, tmp / "config.json")
            build_char_tokenizer(tmp)
    except FileExistsError:
        raise ConfigError(
            f"make-tiny --out {out_dir}: appeared while writing; pass --force to replace"
        ) from None
    return out_dir
