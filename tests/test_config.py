"""Configuration: schema, overrides, one-line errors with exit code 2, and shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slimrl.config import load_config, save_config
from slimrl.config.checks import train_world_size
from slimrl.errors import ConfigError
from slimrl.trainer.parallel import ParallelLayout
from tests.conftest import REPO, run_slimrl


def _base(tiny: Path, *extra: str) -> list[str]:
    return [f"model.hf_checkpoint={tiny}", "cluster.gpus_per_node=4", "cluster.device=cpu", *extra]


@pytest.fixture
def moe(tiny_model) -> Path:
    return tiny_model("qwen3_moe")


def test_overrides_apply_and_paths_become_absolute(moe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    config = load_config(
        None, _base(moe, "parallel.ep=2", "train.optimizer.lr=0.5", "data.prompt_data=p.jsonl")
    )
    assert config.parallel.ep == 2
    assert config.train.optimizer.lr == 0.5
    assert config.data.prompt_data == str(tmp_path / "p.jsonl")


def test_extends_chain_and_saved_config_round_trips(moe, tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"train": {"num_steps": 7, "micro_batch_size": 3}}))
    child = {"extends": "base.yaml", "train": {"num_steps": 9}, "model": {"hf_checkpoint": str(moe)}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(child))
    config = load_config(tmp_path / "run.yaml", ["cluster.gpus_per_node=1"])
    assert (config.train.num_steps, config.train.micro_batch_size) == (9, 3)
    saved = save_config(config, tmp_path / "out" / "config.yaml")
    assert load_config(saved) == config


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("parallel.tpp=2", "unknown key `parallel.tpp` (did you mean `parallel.tp`?)"),
        ("rollout.n_sample_per_prompt=4", "did you mean `rollout.n_samples_per_prompt`?"),
        ("parallel.tp=two", "`parallel.tp`"),
        ("train.optimizer.lr=fast", "`train.optimizer.lr`"),
        ("rollout.engine=vllm", "rollout.engine=vllm: not one of embedded, sglang"),
        ("data.prompt_data=/no/such/file.jsonl", "data.prompt_data=/no/such/file.jsonl: file not found"),
        ("parallel.tp=3", "parallel.tp=3: must divide the model's 4 attention heads"),
        ("parallel.ep=3", "parallel.ep=3: must divide the model's 4 experts"),
        ("parallel.pp=4", "parallel.pp=4: pp*vpp = 4 pipeline stages for only 2 layers"),
        ("parallel.dp=3", "parallel.dp=3: tp*pp*cp*dp = 3 but the training world size is 4"),
        ("parallel.cp=2", "parallel.cp=2: context parallelism needs Transformer Engine"),
        ("parallel.fp8=blockwise", "parallel.fp8=blockwise: FP8 needs Transformer Engine on a GPU"),
        ("parallel.sequence_parallel=false", "parallel.sequence_parallel=false"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(moe, override, fragment):
    extra = ["parallel.tp=2"] if override.startswith("parallel.sequence_parallel") else []
    with pytest.raises(ConfigError) as info:
        load_config(None, _base(moe, *extra, override))
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_tp_must_divide_query_groups(tiny_model):
    four_groups = tiny_model("qwen3", num_key_value_heads=1)
    with pytest.raises(ConfigError, match=r"parallel.tp=2: must divide the model's 1 query groups"):
        load_config(None, _base(four_groups, "parallel.tp=2"))


def test_etp_times_ep_must_divide_expert_data_world(moe):
    with pytest.raises(ConfigError, match=r"ep\*etp = 8 must divide the expert-data world tp\*cp\*dp = 4"):
        load_config(None, _base(moe, "parallel.ep=4", "parallel.etp=2"))


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_layout_resolution(moe):
    from slimrl.megatron_bridge.model_arch import read_model_arch

    def resolve(*extra):
        config = load_config(None, _base(moe, "parallel.tp=2", "parallel.ep=2", *extra))
        return ParallelLayout.resolve(config.parallel, train_world_size(config), read_model_arch(moe))

    layout = resolve()
    assert (layout.tp, layout.dp, layout.ep, layout.etp, layout.expert_dp) == (2, 2, 2, 2, 1)
    assert layout.sequence_parallel  # derived: on whenever tp > 1
    layout = resolve("parallel.etp=1")
    assert (layout.etp, layout.expert_dp) == (1, 2)


def test_expert_tp_must_equal_tp_without_expert_parallelism(moe):
    with pytest.raises(
        ConfigError, match=r"parallel.etp=1: with parallel.ep=1 expert-TP must equal parallel.tp=2"
    ):
        load_config(None, _base(moe, "parallel.tp=2", "parallel.etp=1"))


def test_cli_exits_2_with_one_line_for_tp3(moe, mod_sum_data):
    config = str(REPO / "configs" / "tiny_moe_cpu.yaml")
    proc = run_slimrl(
        "train", config, f"model.hf_checkpoint={moe}", f"data.prompt_data={mod_sum_data}", "parallel.tp=3"
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.tp" in lines[0], proc.stderr


def test_every_shipped_config_loads(moe, mod_sum_data, monkeypatch):
    """Big-model configs load as shipped (their config.json lives in configs/models/); tiny ones
    get the local tiny model and data."""
    monkeypatch.chdir(REPO)
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        if "configs/models/" in path.read_text():
            config = load_config(path)
            assert config.rollout.engine == "sglang" and config.cluster.device == "cuda"
        else:
            load_config(
                path, [f"model.hf_checkpoint={moe}", f"data.prompt_data={mod_sum_data}", "cluster.device=cpu"]
            )


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["algorithm.advantage_estimator=gspo"],
            "algorithm.loss_reduction=token_mean: advantage_estimator=gspo is the mean over sequences of "
            "the sequence-level objective; set algorithm.loss_reduction=seq_mean_token_mean",
        ),
        (
            ["algorithm.advantage_estimator=gspo", "algorithm.loss_reduction=seq_mean_token_sum_norm"],
            "algorithm.loss_reduction=seq_mean_token_sum_norm: advantage_estimator=gspo",
        ),
        (
            ["algorithm.advantage_estimator=rloo", "rollout.n_samples_per_prompt=1"],
            "rollout.n_samples_per_prompt=1: rloo needs groups of at least 2 samples",
        ),
        (
            ["algorithm.advantage_estimator=reinforce_plus_plus_baseline", "rollout.n_samples_per_prompt=1"],
            "reinforce_plus_plus_baseline needs groups of at least 2 samples",
        ),
        (
            ["algorithm.advantage_estimator=rloo", "algorithm.normalize_std=false"],
            "algorithm.normalize_std=false: only grpo/gspo divide by the group std",
        ),
        (
            ["algorithm.kl_coef=0.05"],
            "algorithm.kl_coef=0.05: the KL reward penalty needs a token-level estimator "
            "(reinforce_plus_plus, reinforce_plus_plus_baseline, ppo); with advantage_estimator=grpo use "
            "algorithm.kl_loss_coef",
        ),
        (["algorithm.gamma=0.9"], "algorithm.gamma=0.9: discounts token-level returns"),
        (
            ["algorithm.advantage_estimator=reinforce_plus_plus", "algorithm.lambd=0.95"],
            "algorithm.lambd=0.95: the GAE lambda applies to advantage_estimator=ppo only",
        ),
        (
            ["algorithm.loss_reduction=seq_mean_token_sum_norm", "algorithm.loss_norm_tokens=0"],
            "algorithm.loss_norm_tokens=0: must be a positive number of tokens",
        ),
        (
            ["algorithm.tis_clip_low=2.0", "algorithm.tis_clip_high=1.0"],
            "algorithm.tis_clip_low=2.0: must satisfy 0 <= tis_clip_low <= tis_clip_high",
        ),
        (["algorithm.mis_low=2.0"], "algorithm.mis_low=2.0: must satisfy 0 <= mis_low < mis_high"),
        (
            ["algorithm.tis=true", "algorithm.use_rollout_logprobs=true"],
            "algorithm.tis=true: corrects the trainer's old logprobs against the rollout's",
        ),
        (
            ["algorithm.overlong_buffer_len=100", "rollout.sampling.max_new_tokens=64"],
            "algorithm.overlong_buffer_len=100: the soft overlong buffer must be 1..64 tokens",
        ),
        (
            ["rollout.dynamic_sampling_std_threshold=0.1"],
            "set rollout.dynamic_sampling_filter_path=slimrl.rollout.filters.nonzero_reward_std",
        ),
        (["algorithm.mis_level=seq"], "algorithm.mis_level=seq: not one of token, sequence, geometric"),
        (["algorithm.tis_level=geometric"], "algorithm.tis_level=geometric: not one of token, sequence"),
        (["algorithm.grpo_std=sample"], "algorithm.grpo_std=sample: not one of unbiased, population"),
        (["algorithm.advantage_estimator=dr_grpo"], "algorithm.advantage_estimator=dr_grpo: not one of grpo"),
    ],
    ids=lambda v: v[-1] if isinstance(v, list) else None,
)
def test_undefined_algorithm_combinations_are_refused_in_one_line(moe, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, _base(moe, *overrides))
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.advantage_estimator=gspo", "algorithm.loss_reduction=seq_mean_token_mean"],
        ["algorithm.advantage_estimator=rloo", "algorithm.grpo_std=population"],
        ["algorithm.normalize_std=false", "algorithm.loss_reduction=seq_mean_token_sum_norm"],  # Dr.GRPO
        [
            "algorithm.advantage_estimator=reinforce_plus_plus_baseline",
            "algorithm.kl_coef=0.01",
            "algorithm.gamma=0.99",
        ],
        [  # DAPO
            "algorithm.eps_clip_high=0.28",
            "algorithm.overlong_buffer_len=16",
            "algorithm.overlong_filtering=true",
            "rollout.dynamic_sampling_filter_path=slimrl.rollout.filters.nonzero_reward_std",
            "rollout.dynamic_sampling_std_threshold=0.1",
        ],
        [
            "algorithm.tis=true",
            "algorithm.tis_level=sequence",
            "algorithm.mis=true",
            "algorithm.mis_level=geometric",
        ],
    ],
    ids=lambda o: o[0].split(".")[-1],
)
def test_defined_algorithm_combinations_load(moe, overrides):
    load_config(None, _base(moe, *overrides))
