"""A tool-use task that learns, end to end on CPU (docs/agentic.md, "A task that learns"): the tiny
Qwen3-MoE, a supervised warm start on tool conversations, then GRPO through the agent endpoint with
plain OpenAI-SDK agent code (`examples/calculator_agent.py`), with a control inside the same run."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

import pytest

from slimrl.cli import main
from slimrl.data.toy_tasks import CALCULATOR_TOOL, make_data
from tests.conftest import REPO, run_slimrl

pytestmark = pytest.mark.slow

RL_STEPS = 14


def _samples(run_dir: Path) -> dict[int, list[dict]]:
    by_rollout: dict[int, list[dict]] = {}
    for line in (run_dir / "rollout_samples.jsonl").open():
        record = json.loads(line)
        if record["split"] == "train":
            by_rollout.setdefault(record["rollout_id"], []).append(record)
    return by_rollout


def _rate(records: list[dict], key: str, control: bool) -> float:
    return mean(r["reward"][key] for r in records if ("control_score" in r["reward"]) == control)


def test_the_agents_tool_matches_the_warm_start_data() -> None:
    from examples import calculator_agent

    assert calculator_agent.TOOLS == [CALCULATOR_TOOL]  # the same system turn in SFT and RL


def test_grpo_through_the_endpoint_learns_to_use_the_calculator(tmp_path: Path, tiny_model) -> None:
    """Stage 1 (SFT, 100 steps) calls the tool about 4 times in 10 and guesses otherwise; stage 2
    (GRPO, 16 tasks x 8 agent runs per step) learns that the tool pays. In the same run, tasks whose
    first number is odd get a calculator that answers a random digit: the model calls it there as
    often (it cannot tell the tasks apart), and their reward stays at chance, so the rise is what
    the tool says, not the act of calling it. Measured (session 26, lr 5e-4, six runs: this test
    three times, three more GRPO stages from one of its warm starts): the tool tasks' reward 0.47
    at the first rollout and 0.93-0.95 over the last three, their call rate 0.44 -> 0.93-0.95;
    the control tasks' call rate 0.38 -> 0.92-0.93, their reward 0.06-0.11 (chance: 0.1). The
    bounds leave 0.17 below that: at lr 1e-3 (session 25's config) CI's run ended at 0.83 and
    two runs here dipped to 0.4-0.5 for one rollout."""
    sft_data = make_data("tool_sum_sft", tmp_path / "sft.jsonl", num_samples=1000, seed=0)
    rl_data = make_data("tool_sum", tmp_path / "rl.jsonl", num_samples=1000, seed=0)
    sft = run_slimrl(
        "train", str(REPO / "configs" / "tiny_moe_tool_sft_cpu.yaml"),
        f"model.hf_checkpoint={tiny_model('qwen3_moe')}", f"data.prompt_data={sft_data}",
        f"run.runs_dir={tmp_path}", "logging.tensorboard=false",
    )  # fmt: skip
    assert sft.returncode == 0, sft.stderr[-3000:]
    warm = tmp_path / "tiny_moe_tool_sft" / "checkpoints" / "iter_0000100" / "hf"
    rl = run_slimrl(
        "train", str(REPO / "configs" / "tiny_moe_tool_grpo_cpu.yaml"),
        f"model.hf_checkpoint={warm}", f"data.prompt_data={rl_data}", f"run.runs_dir={tmp_path}",
        "rollout.agent_function_path=examples.calculator_agent.run_agent_with_control",
        f"train.num_steps={RL_STEPS}", "logging.tensorboard=false",
    )  # fmt: skip
    assert rl.returncode == 0, rl.stderr[-3000:]
    rollouts = _samples(tmp_path / "tiny_moe_tool_grpo")
    assert sorted(rollouts) == list(range(RL_STEPS)) and all(len(r) == 128 for r in rollouts.values())
    first, last = rollouts[0], [r for i in range(RL_STEPS - 3, RL_STEPS) for r in rollouts[i]]
    # the warm start: some calls, mostly guesses; the tool tasks score about the call rate
    assert 0.15 < _rate(first, "called_tool", False) < 0.7 and _rate(first, "score", False) < 0.7
    assert (
        json.loads((tmp_path / "tiny_moe_tool_grpo" / "metrics.jsonl").open().readline())[
            "rollout/agent_malformed_tool_calls"
        ]
        > 0
    )  # the warm start still writes some calls the parser cannot read
    # after RL: the tool tasks are right almost always, and the model calls the tool everywhere...
    tool_reward = _rate(last, "score", False)
    assert tool_reward > 0.75 and tool_reward - _rate(first, "score", False) > 0.3
    assert _rate(last, "called_tool", False) > 0.75 and _rate(last, "called_tool", True) > 0.75
    # ...yet where the tool says nothing, the reward stays at chance (1 in 10; ~190 samples)
    assert _rate(last, "score", True) < 0.25
    assert all(record["metadata"]["agent"]["calls"] == 1 for record in last)
    # the two halves' curves are metrics of their own (each reward entry's mean over the samples
    # that report it), and `slimrl plot` draws them on one figure (the README's)
    run_dir = tmp_path / "tiny_moe_tool_grpo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    for step, row in enumerate(rows):  # malformed calls: counted per turn (SGLang's parser's verdict)
        malformed = [t for r in rollouts[step] for t in r["metadata"]["agent_sequence"]["turns"]]
        assert row["rollout/agent_malformed_tool_calls"] == sum(
            bool(t.get("malformed_tool_call")) for t in malformed
        )
        assert row["rollout/reward/tool_score"] == pytest.approx(_rate(rollouts[step], "score", False))
        assert row["rollout/reward/control_score"] == pytest.approx(_rate(rollouts[step], "score", True))
    keys = ["--key", "rollout/reward/tool_score", "--key", "rollout/reward/control_score"]
    assert main(["plot", str(run_dir), *keys]) == 0
    assert (run_dir / "rollout_reward_tool_score+rollout_reward_control_score.png").stat().st_size > 10_000
