"""Hostile inputs, one place: what a careless or hostile user can type or a hook can return, each
answered by one line naming the key, hook or field at fault, with nothing written or lost.

Grows with every bug found (issue 13). Fast cases live here; those that need a fleet or a run
sit beside their subsystem's tests and are named from here.
"""

from __future__ import annotations

import numpy as np
import pytest

from slimrl.errors import SlimError
from slimrl.rollout.sample_checks import GENERATE_KEY, check_sample, model_vocab_size
from slimrl.sample import Sample, Status

VOCAB = 50


def sample(**fields) -> Sample:
    base = {"index": 7, "tokens": [1, 2, 3, 4, 5], "response_length": 2, "status": Status.COMPLETED,
            "loss_mask": [1, 1], "rollout_log_probs": [-0.5, -1.0]}  # fmt: skip
    return Sample(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "field", "needle"),
    [
        ({"status": Status.PENDING}, "status", "is still pending: the hook must set it"),
        ({"status": "done"}, "status", "is 'done'; expected one of completed, truncated, aborted, failed"),
        ({"tokens": ["1", "2", "3"]}, "tokens", "holds '1' (str); expected int token ids"),
        ({"tokens": [1, 2, 3.0]}, "tokens", "holds 3.0 (float)"),
        ({"tokens": (1, 2, 3)}, "tokens", "is a tuple; expected list[int]"),
        (
            {"tokens": [1, 2, VOCAB]},
            "tokens",
            f"holds id {VOCAB}, outside the model's vocabulary [0, {VOCAB})",
        ),
        ({"tokens": [1, -1, 2]}, "tokens", "holds id -1"),
        ({"response_length": 6}, "response_length", "is 6; expected an int in [0, len(tokens)=5]"),
        ({"response_length": -1}, "response_length", "is -1"),
        ({"response_length": 2.0}, "response_length", "is 2.0"),
        ({"loss_mask": [1, 1, 1]}, "loss_mask", "has 3 entries; expected one per response token (2)"),
        ({"loss_mask": [1, 2]}, "loss_mask", "must hold only 0 and 1"),
        ({"loss_mask": "11"}, "loss_mask", "is a str; expected a list"),
        ({"rollout_log_probs": [-0.5]}, "rollout_log_probs", "has 1 entries"),
        (
            {"rollout_log_probs": [-0.5, float("nan")]},
            "rollout_log_probs",
            "must be finite log-probabilities",
        ),
        ({"rollout_log_probs": [-0.5, 0.7]}, "rollout_log_probs", "must be finite log-probabilities"),
    ],
)
def test_bad_hook_samples_are_one_line_naming_hook_sample_and_field(fields, field, needle) -> None:
    with pytest.raises(SlimError) as err:
        check_sample(sample(**fields), GENERATE_KEY, VOCAB)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{GENERATE_KEY}: sample 7: {field} ") and needle in message, message


def test_a_finished_sample_longer_than_max_seq_len_is_one_line() -> None:
    check_sample(sample(), GENERATE_KEY, VOCAB, max_seq_len=5)  # exactly the limit fits
    check_sample(sample(status=Status.ABORTED), GENERATE_KEY, VOCAB, max_seq_len=4)  # continued later
    with pytest.raises(SlimError) as err:
        check_sample(sample(), GENERATE_KEY, VOCAB, max_seq_len=4)
    assert str(err.value) == (
        f"{GENERATE_KEY}: sample 7: tokens has 5 tokens (3 prompt + 2 response), more than "
        "train.max_seq_len=4; raise train.max_seq_len or make the hook stop its turns within it"
    )
    with pytest.raises(SlimError, match=r"or set data\.max_prompt_tokens so prompt"):
        check_sample(sample(status=Status.TRUNCATED), "generate", VOCAB, max_seq_len=4)


def test_loosely_typed_but_meaningful_samples_are_normalised() -> None:
    """numpy ids and a status given as its string value are what a hook naturally returns."""
    one = sample(tokens=list(np.array([1, 2, 3, 4, 5])), status="truncated", response_length=np.int64(2))
    check_sample(one, GENERATE_KEY, VOCAB)
    assert one.status is Status.TRUNCATED and one.response_length == 2
    assert [type(t) for t in one.tokens] == [int] * 5


def test_an_aborting_rollout_accepts_unfinished_samples() -> None:
    check_sample(sample(status=Status.PENDING), GENERATE_KEY, VOCAB, allow_pending=True)


def test_vocab_bound_is_the_model_embedding_size(tiny_model) -> None:
    import json

    hf = tiny_model("qwen3_moe")
    assert model_vocab_size(str(hf)) == json.loads((hf / "config.json").read_text())["vocab_size"]


def test_a_fresh_start_over_an_earlier_runs_checkpoints_is_one_line_before_anything(
    tmp_path, tiny_model, mod_sum_data
) -> None:
    """Before: it started from step 1, rewrote metrics.jsonl and pruned the earlier checkpoints."""
    from tests.conftest import run_slimrl

    run_dir = tmp_path / "runs" / "again"
    earlier = run_dir / "checkpoints" / "iter_0000007"
    earlier.mkdir(parents=True)
    (earlier / "driver_state.json").write_text('{"step": 7}')
    proc = run_slimrl(
        "train", "configs/tiny_moe_grpo_cpu.yaml", f"model.hf_checkpoint={tiny_model('qwen3_moe')}",
        f"data.prompt_data={mod_sum_data}", f"run.runs_dir={tmp_path / 'runs'}", "run.name=again",
        "checkpoint.resume=false", timeout=120,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "checkpoint.resume=false: " in lines[0] and "iter_0000007" in lines[0]
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]  # no config.yaml, no logs


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["rollout.sampling.temperature=-1"], "rollout.sampling.temperature=-1.0: must be >= 0"),
        (["eval.sampling.top_p=2"], "eval.sampling.top_p=2.0: must be in (0, 1]"),
        (["train.global_batch_size=0"], "train.global_batch_size=0: must be >= 1"),
        (["train.optimizer.lr=-0.001"], "train.optimizer.lr=-0.001: must be > 0"),
        (["rollout.custom_rm_path=nope.rm"], "rollout.custom_rm_path=nope.rm: cannot import module `nope`"),
        (["data.prompt_data={empty}"], "data.prompt_data={empty}: holds no records (empty file)"),
        (
            ["rollout.reward_type=remote", "rollout.remote_rm_url=rm.internal:8000"],
            "rollout.remote_rm_url=rm.internal:8000: not an http(s) URL",
        ),
        (["algorithm.loss=sft", "train.global_batch_size=33"], "train.global_batch_size=33: SFT steps of 33"),
    ],
    ids=lambda v: v[0].split("=")[0] if isinstance(v, list) else None,
)
def test_bad_config_values_stop_slimrl_train_before_anything_is_created(
    tmp_path, tiny_model, mod_sum_data, overrides, needle
) -> None:
    """Before: sampling values, hooks, data files, the reward URL and SFT batch divisibility failed
    16-44 s in, after Ray, the trainers and the engines were up (exit 1, a Ray traceback, a half-made
    run directory). Now: at load, one line, exit 2, no run directory."""
    from tests.conftest import run_slimrl

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    runs = tmp_path / "runs"
    proc = run_slimrl(
        "train", "configs/tiny_moe_grpo_cpu.yaml", f"model.hf_checkpoint={tiny_model('qwen3_moe')}",
        f"data.prompt_data={mod_sum_data}", f"run.runs_dir={runs}",
        *(o.format(empty=empty) for o in overrides), timeout=120,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("slimrl: error: ") and needle.format(empty=empty) in lines[0], lines[0]
    assert not runs.exists()
