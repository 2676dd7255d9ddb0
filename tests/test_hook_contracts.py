"""Hook contracts: each kind of hook loads by dotted path with its signature checked up front.

The shipped examples satisfy their contracts; a bad path, a sync function where an async one is
awaited (or the reverse), or a signature that cannot take the arguments is one `ConfigError` line
naming the config key, raised by `check_hooks` before any engine starts.
"""

from __future__ import annotations

from typing import Any

import pytest

import examples.custom_reward
import examples.custom_rollout
import examples.filters
import examples.multi_turn_tool_generate
from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.rollout import filters
from slimrl.rollout.data_source import DataSource
from slimrl.rollout.generate import generate
from slimrl.rollout.hooks import HOOKS, check_hooks, load_hook
from slimrl.rollout.rollout import load_generate_fn
from slimrl.sample import Sample

ME = "test_hook_contracts"


def config_with(**rollout: Any) -> SlimConfig:
    config = SlimConfig()
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    return config


# --- hooks with the wrong shape, referenced as test_hook_contracts.<name> ------------------------


def sync_generate(ctx: Any, sample: Any, sampling_params: Any) -> Any:
    return sample


async def two_param_generate(ctx: Any, sample: Any) -> Any:
    return sample


def sync_reward(config: Any, sample: Any) -> float:
    return 1.0


async def three_param_reward(config: Any, sample: Any, extra: Any) -> float:
    return 1.0


async def async_filter(config: Any, group: Any) -> bool:
    return True


def one_param_filter(group: Any) -> bool:
    return True


def two_param_buffer_filter(buffer: Any, n: Any) -> list:
    return []


def sync_rollout(ctx: Any, data_source: Any, evaluation: Any) -> list:
    return []


async def keyword_only_rollout(ctx: Any, *, data_source: Any, evaluation: Any) -> list:
    return []


def test_shipped_examples_and_builtins_satisfy_their_contracts() -> None:
    config = config_with(
        custom_generate_function_path="examples.multi_turn_tool_generate.generate",
        custom_rm_path="examples.custom_reward.reward",
        dynamic_sampling_filter_path="examples.filters.informative_group",
        buffer_filter_path="examples.filters.oldest_first",
        rollout_function_path="examples.custom_rollout.rollout",
    )
    check_hooks(config)
    assert load_generate_fn(config) is examples.multi_turn_tool_generate.generate
    assert load_hook(config, "reward") is examples.custom_reward.reward
    assert load_hook(config, "filter") is examples.filters.informative_group
    assert load_hook(config, "buffer_filter") is examples.filters.oldest_first
    assert load_hook(config, "rollout") is examples.custom_rollout.rollout
    builtin = config_with(dynamic_sampling_filter_path="slimrl.rollout.filters.nonzero_reward_std")
    assert load_hook(builtin, "filter") is filters.nonzero_reward_std
    defaults = SlimConfig()
    check_hooks(defaults)  # nothing configured: the built-in generate, no hooks
    assert load_generate_fn(defaults) is generate
    assert all(load_hook(defaults, name) is None for name in HOOKS)
    # the table's keys are the config's hook keys, every one of them
    hook_fields = {f for f in SlimConfig().rollout.__slots__ if f.endswith("_path")}
    assert {kind.field for kind in HOOKS.values()} == hook_fields


def test_group_rm_contract() -> None:
    """With group_rm the hook gets the whole group (config, samples)."""
    assert load_hook(config_with(custom_rm_path="examples.custom_reward.reward", group_rm=True), "reward")
    message = _error(config_with(custom_rm_path=f"{ME}.three_param_reward", group_rm=True))
    assert "cannot be called as f(config, samples)" in message


BAD_HOOKS = [
    ("custom_generate_function_path", f"{ME}.sync_generate", "must be an `async def` function"),
    ("custom_generate_function_path", f"{ME}.two_param_generate", "f(ctx, sample, sampling_params)"),
    ("custom_rm_path", f"{ME}.sync_reward", "must be an `async def` function"),
    ("custom_rm_path", f"{ME}.three_param_reward", "cannot be called as f(config, sample)"),
    ("dynamic_sampling_filter_path", f"{ME}.async_filter", "must be a plain `def` function"),
    ("dynamic_sampling_filter_path", f"{ME}.one_param_filter", "f(config, group)"),
    ("buffer_filter_path", f"{ME}.two_param_buffer_filter", "f(config, buffer, n)"),
    ("rollout_function_path", f"{ME}.sync_rollout", "must be an `async def` function"),
    ("rollout_function_path", f"{ME}.keyword_only_rollout", "f(ctx, data_source, evaluation)"),
]
KEYS = sorted({key for key, _, _ in BAD_HOOKS})


def _error(config: SlimConfig) -> str:
    with pytest.raises(ConfigError) as info:
        check_hooks(config)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("key", "path", "needle"), BAD_HOOKS)
def test_wrong_signature_is_one_line_naming_the_key(key: str, path: str, needle: str) -> None:
    message = _error(config_with(**{key: path}))
    assert message.startswith(f"rollout.{key}={path}: ") and needle in message


@pytest.mark.parametrize("key", KEYS)
def test_bad_paths_are_one_line_naming_the_key(key: str) -> None:
    missing_module = _error(config_with(**{key: "no_such_hooks_pkg.fn"}))
    assert missing_module.startswith(f"rollout.{key}=no_such_hooks_pkg.fn: cannot import module")
    missing_attr = _error(config_with(**{key: "examples.filters.no_such_fn"}))
    assert "has no attribute `no_such_fn`" in missing_attr and "public callables:" in missing_attr
    assert "expected a dotted path" in _error(config_with(**{key: "nodots"}))


def test_buffer_filter_chooses_which_partial_groups_continue(mod_sum_data) -> None:
    config = config_with(buffer_filter_path="examples.filters.oldest_first")
    config.data.prompt_data = str(mod_sum_data)
    source = DataSource(config)
    groups = [
        [Sample(index=i, metadata={"start_rollout_id": started})] for i, started in enumerate((5, 2, 9))
    ]
    source.add_to_buffer(groups)
    assert [g[0].index for g in source._from_buffer(2)] == [1, 0]  # oldest first
    assert [g[0].index for g in source.buffer] == [2]
