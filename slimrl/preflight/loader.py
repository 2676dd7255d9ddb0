"""Load `CONFIG.yaml key=value ...` onto the schema, turning every mistake into one line.

A YAML file may start with `extends: base.yaml` (path relative to the file) to build on a shared
base; chains are allowed. Overrides use OmegaConf dotlist syntax (`parallel.tp=2`).
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.preflight.checks import check_config
from slimrl.utils.fs import atomic_write_text

_EXTENDS_KEY = "extends"


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `extends` chain loops back to itself")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    base_name = raw.pop(_EXTENDS_KEY, None)
    node = OmegaConf.create(raw)
    if base_name is None:
        return node
    base = _read_yaml(path.parent / str(base_name), (*seen, path.resolve()))
    return OmegaConf.merge(base, node)


def _schema_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        keys.append(name)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(_schema_keys(type(default), name + "."))
    return keys


def _unknown_key_message(full_key: str, source: str) -> str:
    candidates = _schema_keys(SlimConfig)
    guess = difflib.get_close_matches(full_key, candidates, n=1, cutoff=0.6)
    if not guess:  # a typo in a leaf name is more likely than in the section
        leaf = full_key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in candidates}
        guess = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    hint = f" (did you mean `{guess[0]}`?)" if guess else ""
    return f"{source}: unknown key `{full_key}`{hint}"


def _merge_error(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError):
        return ConfigError(_unknown_key_message(key, source))
    message = str(getattr(exc, "msg", exc)).splitlines()[0]
    return ConfigError(f"{source}: `{key}`: {message}")


def _merge(schema: DictConfig, layers: list[tuple[str, DictConfig]]) -> DictConfig:
    """All layers in one merge (each merge deep-copies the whole schema); on an error, again one
    layer at a time to name the file or override at fault."""
    try:
        return OmegaConf.merge(schema, *(layer for _, layer in layers))  # type: ignore[return-value]
    except OmegaConfBaseException:
        pass
    merged = schema
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)  # type: ignore[assignment]
        except OmegaConfBaseException as exc:
            raise _merge_error(exc, source) from None
    return merged


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> SlimConfig:
    """Merge a YAML file and dotlist overrides onto the schema, then run the checks."""
    schema = OmegaConf.structured(SlimConfig)
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        layers.append((str(path), _read_yaml(Path(path))))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override `{item}` is not of the form key=value")
        layers.append((f"override `{item}`", OmegaConf.from_dotlist([item])))
    merged = _merge(schema, layers)
    try:
        config: SlimConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{path}: `{exc.full_key}` must be set") from None
    except OmegaConfBaseException as exc:
        raise _merge_error(exc, str(path)) from None

    _make_paths_absolute(config)
    check_config(config)
    return config


_PATH_KEYS = (
    ("run", "runs_dir"),
    ("model", "hf_checkpoint"),
    ("model", "load"),
    ("model", "ref_load"),
    ("critic", "load"),
    ("data", "prompt_data"),
    ("checkpoint", "save_dir"),
)


def _make_paths_absolute(config: SlimConfig) -> None:
    """Relative paths mean relative to where `slimrl` was started; actors run elsewhere."""
    for section, key in _PATH_KEYS:
        owner = getattr(config, section)
        value = getattr(owner, key)
        if value and value != "???":
            setattr(owner, key, str(Path(value).expanduser().absolute()))
    config.eval.datasets = {k: str(Path(v).expanduser().absolute()) for k, v in config.eval.datasets.items()}


def to_yaml(config: SlimConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


SECRET_KEYS = (("rollout", "api_key"), ("rollout", "admin_api_key"))
"""Never written to a file: a saved config has them null, with a comment saying so."""


def save_config(config: SlimConfig, path: str | os.PathLike[str]) -> Path:
    """Write the config atomically (temp file, then rename), without its secrets (`SECRET_KEYS`)."""
    clean = copy.deepcopy(config)
    removed = []
    for section, key in SECRET_KEYS:
        if getattr(getattr(clean, section), key) is not None:
            setattr(getattr(clean, section), key, None)
            removed.append(f"{section}.{key}")
    header = (
        f"# {', '.join(removed)}: not written (secret); pass again to run from this file\n" if removed else ""
    )
    return atomic_write_text(Path(path), header + to_yaml(clean))
