"""Every kind of user hook the rollout side loads by dotted path, in one table: its config key,
the arguments it is called with, whether it must be async, and its protocol. Adding a hook kind is
one entry here (and the call site that uses it); `load_hook` loads and checks any of them, and the
config gate loads every configured one before anything starts (`check_hooks`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from slimrl.utils.hooks import load_function

if TYPE_CHECKING:
    from slimrl.config.schema import SlimConfig
    from slimrl.rollout.data_source import DataSource, Group
    from slimrl.rollout.generate import RolloutContext
    from slimrl.sample import Sample


class GenerateHook(Protocol):
    def __call__(
        self, ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
    ) -> Awaitable[Sample | list[Sample]]: ...


class RolloutHook(Protocol):
    def __call__(
        self, ctx: RolloutContext, data_source: DataSource, evaluation: bool
    ) -> Awaitable[list[Group]]: ...


class RewardHook(Protocol):
    """`(config, sample)`, or `(config, samples)` with `rollout.group_rm`."""

    def __call__(self, config: SlimConfig, sample_or_samples: Any) -> Awaitable[Any]: ...


class AgentHook(Protocol):
    """An agent written against the OpenAI API (`rollout/agent/`): the reward, or reward and metadata."""

    def __call__(
        self, base_url: str, api_key: str, task: dict[str, Any]
    ) -> Awaitable[float | dict[str, Any]]: ...


class FilterHook(Protocol):
    def __call__(self, config: SlimConfig, group: Group) -> bool: ...


class BufferFilterHook(Protocol):
    def __call__(self, config: SlimConfig, buffer: list[Group], n: int) -> list[Group]: ...


HookName = Literal["generate", "rollout", "reward", "filter", "buffer_filter", "agent"]


@dataclass(frozen=True)
class HookKind:
    field: str
    """Its key under `rollout.` in the config."""
    params: tuple[str, ...]
    """The positional arguments it is called with (names, for messages and the signature check)."""
    is_async: bool
    protocol: type
    group_params: tuple[str, ...] | None = None
    """`params` when `rollout.group_rm` is set (the reward hook then scores a whole group)."""


HOOKS: dict[HookName, HookKind] = {
    "generate": HookKind(
        "custom_generate_function_path", ("ctx", "sample", "sampling_params"), True, GenerateHook
    ),
    "rollout": HookKind("rollout_function_path", ("ctx", "data_source", "evaluation"), True, RolloutHook),
    "reward": HookKind("custom_rm_path", ("config", "sample"), True, RewardHook, ("config", "samples")),
    "filter": HookKind("dynamic_sampling_filter_path", ("config", "group"), False, FilterHook),
    "buffer_filter": HookKind("buffer_filter_path", ("config", "buffer", "n"), False, BufferFilterHook),
    "agent": HookKind("agent_function_path", ("base_url", "api_key", "task"), True, AgentHook),
}


def load_hook(config: SlimConfig, name: HookName) -> Callable[..., Any] | None:
    """The `name` hook the config names, loaded and checked (cached); None when it names none."""
    kind = HOOKS[name]
    path = getattr(config.rollout, kind.field)
    if path is None:
        return None
    grouped = kind.group_params is not None and config.rollout.group_rm
    params = kind.group_params if grouped else kind.params
    key = f"rollout.{kind.field}"
    return load_function(path, key=key, required_params=params, must_be_async=kind.is_async)


def check_hooks(config: SlimConfig) -> None:
    """Load every configured hook now, so a bad path or signature fails as one `ConfigError` line
    before any engine starts or any token is generated."""
    for name in HOOKS:
        load_hook(config, name)
