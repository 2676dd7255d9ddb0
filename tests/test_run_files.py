"""What a run writes beside its metrics, and the schema fields that shape it: `rollout_samples.jsonl`
(`rollout.save_samples`), prompts dropped by `data.max_prompt_tokens`, progress lines every
`logging.log_interval` steps. Fast, no processes; the end-to-end runs check the same files."""

from __future__ import annotations

import json
import logging

import pytest

from slimrl.data.prompts import PromptRecord, drop_long_prompts
from slimrl.errors import ConfigError
from slimrl.orchestration.metrics import log_due
from slimrl.orchestration.sample_log import SAMPLES_FILE, SampleLog, start_samples, write_samples
from slimrl.sample import Sample, Status


def _groups(rollout_id: int, n: int = 2) -> list[list[Sample]]:
    return [[Sample(index=rollout_id * n + i, tokens=[1, 2], response_length=1, status=Status.COMPLETED)
             for i in range(n)]]  # fmt: skip


def test_samples_file_is_fresh_for_a_new_run_and_cut_at_the_checkpoint_on_resume(tmp_path) -> None:
    path = start_samples(tmp_path)
    assert path == tmp_path / SAMPLES_FILE and path.read_text() == ""
    for rollout_id in range(5):
        write_samples(path, rollout_id, _groups(rollout_id), "train")
    with path.open("a") as handle:
        handle.write('{"rollout_id": 5, "spl')  # a line cut by a kill
    records = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    assert [r["rollout_id"] for r in records] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert Sample.from_dict(records[3]).index == 3 and records[3]["split"] == "train"

    start_samples(tmp_path, start_rollout=3)  # resumed after step 3: rollouts 3.. are redone
    kept = [json.loads(line)["rollout_id"] for line in path.read_text().splitlines()]
    assert kept == [0, 0, 1, 1, 2, 2]
    assert not list(tmp_path.glob("*.partial"))
    start_samples(tmp_path)  # resume=false, or no checkpoint: a fresh file
    assert path.read_text() == ""


def test_sample_log_writes_in_the_background_in_order_and_surfaces_a_failed_write(tmp_path) -> None:
    log = SampleLog(tmp_path)
    for rollout_id in range(3):
        log.append(rollout_id, _groups(rollout_id))
    log.close()
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 0, 1, 1, 2, 2]
    assert records[0] == {"rollout_id": 0, "split": "train", **_groups(0)[0][0].to_dict()}  # as to_dict

    (tmp_path / "again").mkdir()
    broken = SampleLog(tmp_path / "again")
    broken.append(0, [[object()]])  # not a Sample: the write fails on the thread
    with pytest.raises(TypeError):
        broken.close()


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_prompts_longer_than_max_prompt_tokens_are_dropped_and_counted(caplog) -> None:
    records = [PromptRecord(prompt="x" * n, label=None, metadata={}) for n in (3, 8, 5, 9)]
    assert drop_long_prompts(records, _Tokenizer(), None, False) is records
    with caplog.at_level(logging.INFO):
        kept = drop_long_prompts(records, _Tokenizer(), 5, False, "p.jsonl")
    assert [len(r.prompt) for r in kept] == [3, 5]
    assert "data.max_prompt_tokens=5: dropped 2 of 4 prompts of p.jsonl" in caplog.text
    with pytest.raises(
        ConfigError, match=r"^data.max_prompt_tokens=2: every one of the 4 prompts of p.jsonl"
    ):
        drop_long_prompts(records, _Tokenizer(), 2, False, "p.jsonl")


def test_progress_lines_every_log_interval_steps_and_the_last() -> None:
    assert [s for s in range(1, 11) if log_due(s, 10, 1)] == list(range(1, 11))
    assert [s for s in range(1, 11) if log_due(s, 10, 4)] == [4, 8, 10]
    assert [s for s in range(3, 8) if log_due(s, 7, 100)] == [7]  # resumed at 2, only the last
