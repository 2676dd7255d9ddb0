"""Registry of supported architectures, keyed by HF `model_type` (never by substring), and the
lookup that turns an HF config.json into a `ModelArch`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimrl.errors import ConfigError
from slimrl.megatron_bridge.archs import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from slimrl.megatron_bridge.archs.base import ArchSpec
from slimrl.model_arch import ModelArch, read_hf_config

ARCH_SPECS: dict[str, ArchSpec] = {
    module.SPEC.model_type: module.SPEC for module in (qwen3_moe, qwen3, qwen2, llama, deepseek_v3)
}


def arch_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
    model_type = cfg.get("model_type")
    spec = ARCH_SPECS.get(str(model_type))
    if spec is None:
        valid = ", ".join(sorted(ARCH_SPECS))
        raise ConfigError(f"{source}: unsupported model_type `{model_type}` (supported: {valid})")
    try:
        return spec.read_arch(cfg)
    except KeyError as exc:
        raise ConfigError(f"{source}: missing key {exc} for model_type `{model_type}`") from None


def read_model_arch(hf_dir: str | Path, overrides: dict[str, Any] | None = None) -> ModelArch:
    """Read config.json of an HF checkpoint (with `model.overrides` applied)."""
    cfg = {**read_hf_config(hf_dir), **(overrides or {})}
    return arch_from_hf_config(cfg, str(Path(hf_dir) / "config.json"))
