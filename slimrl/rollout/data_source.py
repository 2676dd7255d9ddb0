"""Where rollout groups come from: the prompt data set (seeded epochs) and a buffer of partial
groups returned by earlier rollouts. Its position is part of every checkpoint."""

from __future__ import annotations

import copy
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.data.hf_tokenizer import load_tokenizer
from slimrl.data.prompts import EpochSampler, PromptRecord, drop_long_prompts, load_prompts
from slimrl.errors import ConfigError
from slimrl.rollout.hooks import load_hook
from slimrl.sample import Sample

Group = list[Sample]


class DataSource:
    def __init__(self, config: SlimConfig, path: str | None = None, shuffle: bool | None = None) -> None:
        path = path or config.data.prompt_data
        if path is None:
            raise ConfigError("data.prompt_data: rollouts need a prompt data set")
        data = config.data
        self.config = config
        self.records: list[PromptRecord] = load_prompts(
            path, data.input_key, data.label_key, data.metadata_key, data.tools_key
        )
        if data.max_prompt_tokens is not None:
            tokenizer = load_tokenizer(config.model.hf_checkpoint, config.model.trust_remote_code)
            self.records = drop_long_prompts(
                self.records, tokenizer, data.max_prompt_tokens, data.apply_chat_template, path
            )
        self.sampler = EpochSampler(
            len(self.records), config.run.seed, data.shuffle if shuffle is None else shuffle
        )
        self.buffer: list[Group] = []
        self.next_group_index = 0
        self.next_sample_index = 0

    def _new_group(self, record: PromptRecord, n: int) -> Group:
        group = []
        for _ in range(n):
            group.append(
                Sample(
                    group_index=self.next_group_index,
                    index=self.next_sample_index,
                    prompt=record.prompt,
                    label=record.label,
                    metadata=copy.deepcopy(record.metadata),
                )
            )
            self.next_sample_index += 1
        self.next_group_index += 1
        return group

    def get_groups(self, count: int, n_samples: int | None = None) -> list[Group]:
        """Partial groups from the buffer first (through the buffer filter), then fresh prompts
        with `n_samples` responses each (default `rollout.n_samples_per_prompt`)."""
        n = n_samples or self.config.rollout.n_samples_per_prompt
        taken = self._from_buffer(count) if self.buffer else []
        fresh = [self._new_group(self.records[i], n) for i in self.sampler.take(count - len(taken))]
        return taken + fresh

    def _from_buffer(self, count: int) -> list[Group]:

        pick = load_hook(self.config, "buffer_filter")
        if pick is None:
            taken, self.buffer = self.buffer[:count], self.buffer[count:]
            return taken
        taken = list(pick(self.config, self.buffer, count))[:count]
        chosen = {id(g) for g in taken}
        self.buffer = [g for g in self.buffer if id(g) not in chosen]
        return taken

    def add_to_buffer(self, groups: list[Group]) -> None:
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict(),
            "buffer": [[s.to_dict() for s in g] for g in self.buffer],
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.buffer = [[Sample.from_dict(s) for s in g] for g in state["buffer"]]
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
