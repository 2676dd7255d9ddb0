"""Configuration: schema, overrides, one-line errors with exit code 2, and shipped configs."""

from __future__ import annotations

import ast
import dataclasses
import shutil
import types
import typing
from pathlib import Path

import pytest
import yaml

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.parallel_layout import ParallelLayout
from slimrl.preflight import load_config, save_config
from slimrl.preflight.checks import RANGES, check_run_inputs
from slimrl.preflight.finalize import finalize
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
    from slimrl.megatron_bridge.archs import read_model_arch

    def resolve(*extra):
        config = load_config(None, _base(moe, "parallel.tp=2", "parallel.ep=2", *extra))
        return ParallelLayout.resolve(config.parallel, config.train_world_size(), read_model_arch(moe))

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


def test_routing_replay_is_refused_at_load_on_a_dense_model_and_for_sft(tiny_model, moe, mod_sum_data):
    """Refused by the CLI before Ray starts: exit 2, one line naming the key and the model."""
    dense = tiny_model("qwen3")
    config = str(REPO / "configs" / "tiny_moe_grpo_cpu.yaml")
    proc = run_slimrl(
        "train", config, f"model.hf_checkpoint={dense}", f"data.prompt_data={mod_sum_data}", "parallel.ep=1",
        "algorithm.routing_replay=true",
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "slimrl: error: algorithm.routing_replay=true needs an MoE model; qwen3 in "
        f"model.hf_checkpoint={dense} is dense (no routed experts in its config.json); set it to false"
    ]
    with pytest.raises(ConfigError, match=r"^algorithm.routing_replay=true: SFT \(algorithm.loss=sft\)"):
        load_config(None, _base(moe, "algorithm.loss=sft", "algorithm.routing_replay=true"))
    assert load_config(None, _base(moe, "algorithm.routing_replay=true")).algorithm.routing_replay


def test_routing_replay_counterfactual_needs_replay(moe):
    """The counterfactual compares against replay: without replay it would measure nothing."""
    with pytest.raises(ConfigError) as info:
        load_config(None, _base(moe, "algorithm.routing_replay_counterfactual=true"))
    assert str(info.value) == (
        "algorithm.routing_replay_counterfactual=true: it scores the batch without routing replay for "
        "comparison, which needs algorithm.routing_replay=true; set that to true or this to false"
    )
    both = _base(moe, "algorithm.routing_replay=true", "algorithm.routing_replay_counterfactual=true")
    assert load_config(None, both).algorithm.routing_replay_counterfactual
    assert not load_config(None, _base(moe)).algorithm.routing_replay_counterfactual


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


CISPO = "algorithm.policy_loss=cispo"


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
            ["algorithm.advantage_estimator=gspo", "algorithm.loss_reduction=seq_mean_token_mean", CISPO],
            "algorithm.policy_loss=cispo: CISPO weights each token; advantage_estimator=gspo has a "
            "sequence-level ratio, which only policy_loss=ppo_clip defines",
        ),
        (
            [CISPO, "algorithm.dual_clip_c=3.0"],
            "algorithm.dual_clip_c=3.0: the dual clip bounds PPO's clipped ratio; policy_loss=cispo has none",
        ),
        (["algorithm.policy_loss=ppo"], "algorithm.policy_loss"),
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
            "algorithm.loss_norm_tokens=0: must be a positive number of tokens, or null",
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
        (
            [
                "train.num_steps=10",
                "train.lr_schedule.decay_style=cosine",
                "train.lr_schedule.warmup_steps=10",
            ],
            "train.lr_schedule.warmup_steps=10: must be below the run's optimizer steps (10) for "
            "decay_style=cosine",
        ),
        (
            [
                "train.lr_schedule.decay_style=linear",
                "train.lr_schedule.decay_steps=5",
                "train.lr_schedule.warmup_steps=8",
            ],
            "train.lr_schedule.warmup_steps=8: must be below train.lr_schedule.decay_steps (5)",
        ),
        (
            ["data.max_prompt_tokens=100", "rollout.sampling.max_new_tokens=64", "train.max_seq_len=128"],
            "train.max_seq_len=128: below data.max_prompt_tokens=100 + rollout.sampling.max_new_tokens=64; "
            "raise it to at least 164",
        ),
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


# --- every field: a docstring, a reader and, if numeric, a range ---------------------------------

SCHEMA = REPO / "slimrl" / "config" / "schema.py"
NOT_READERS = ("config/schema.py", "preflight/loader.py", "preflight/checks.py")
"""Declaring, loading or checking a field is not using it: a field read only there does nothing."""


def _schema_fields() -> list[tuple[str, str, bool]]:
    """(class, field, has a docstring) for every field of every dataclass in schema.py."""
    out = []
    for cls in (n for n in ast.parse(SCHEMA.read_text()).body if isinstance(n, ast.ClassDef)):
        for i, node in enumerate(cls.body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                after = cls.body[i + 1] if i + 1 < len(cls.body) else None
                doc = isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant)
                out.append((cls.name, node.target.id, doc and isinstance(after.value.value, str)))  # type: ignore[union-attr]
    return out


def test_every_schema_field_has_a_docstring():
    fields = _schema_fields()
    assert len(fields) > 100
    assert [f"{cls}.{name}" for cls, name, doc in fields if not doc] == []


def test_every_schema_field_is_read_outside_the_config_checks():
    """A field nobody reads is a setting silently ignored: each must be read (as `x.<field>`) by code
    other than the schema, the loader and the checks."""
    read: set[str] = set()
    for path in (REPO / "slimrl").rglob("*.py"):
        if f"{path.parent.name}/{path.name}" in NOT_READERS:
            continue
        nodes = list(ast.walk(ast.parse(path.read_text())))
        read |= {n.attr for n in nodes if isinstance(n, ast.Attribute)}
        # the hook table (`rollout/hooks.py`) names its `rollout.*_path` fields and reads them by name
        read |= {
            n.args[0].value for n in nodes
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "HookKind"
            and n.args and isinstance(n.args[0], ast.Constant)
        }  # fmt: skip
    assert [f"{cls}.{name}" for cls, name, _ in _schema_fields() if name not in read] == []


def _union_members(hint: object) -> tuple[object, ...]:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _numeric_keys(cls: type = SlimConfig, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys = []
    for field in dataclasses.fields(cls):
        kinds = [k for k in _union_members(hints[field.name]) if k is not type(None)]
        if len(kinds) == 1 and dataclasses.is_dataclass(kinds[0]):
            keys += _numeric_keys(kinds[0], f"{prefix}{field.name}.")  # type: ignore[arg-type]
        elif kinds and all(k in (int, float) for k in kinds):
            keys.append(prefix + field.name)
    return keys


def test_every_numeric_field_has_a_range():
    keys = _numeric_keys()
    assert len(keys) > 60
    assert sorted(set(keys) - set(RANGES)) == []  # a numeric field without a range
    assert sorted(set(RANGES) - set(keys)) == []  # a range for no field


def _bad_values(key: str) -> list[str]:
    """Values just outside the field's range, and non-finite ones for floats."""
    valid = RANGES[key]
    integer = int in _union_members(_field_type(key))
    step = 1 if integer else 0.5
    out: list[float] = []
    if valid.low is not None:
        out.append(valid.low if valid.low_open else valid.low - step)
    if valid.high is not None:
        out.append(valid.high if valid.high_open else valid.high + step)
    shown = [str(int(v)) if integer else str(v) for v in out if not (valid.also and v == valid.also[0])]
    return shown if integer else [*shown, "nan", "inf", "-inf"]


def _field_type(key: str) -> object:
    cls: type = SlimConfig
    *sections, leaf = key.split(".")
    for section in sections:
        cls = typing.get_type_hints(cls)[section]
    return typing.get_type_hints(cls)[leaf]


def test_every_bad_numeric_value_is_one_line_naming_the_key(moe):
    """In-process over every numeric field (the CLI maps the same ConfigError to exit 2, before it
    creates anything: tests/test_hostile_inputs.py runs a few through `slimrl train`)."""
    cases = [(key, value) for key in RANGES for value in _bad_values(key)]
    assert len(cases) > 150
    wrong = []
    for key, value in cases:
        try:
            load_config(None, _base(moe, f"{key}={value}"))
            wrong.append(f"{key}={value}: accepted")
        except ConfigError as exc:
            message = str(exc)
            if not message.startswith(f"{key}=") or "\n" in message:
                wrong.append(f"{key}={value}: {message}")
    assert wrong == []


# --- cross-field and file checks at load ----------------------------------------------------------


def _data(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["rollout.sampling.temperature=nan"],
            "rollout.sampling.temperature=nan: must be a finite number, >= 0",
        ),
        (["eval.sampling.top_p=2"], "eval.sampling.top_p=2.0: must be in (0, 1]"),
        (["rollout.sampling.top_k=0"], "rollout.sampling.top_k=0: must be -1 (the whole vocabulary) or >= 1"),
        (["rollout.sampling.stop_token_ids=[5,104]"], "stop_token_ids: holds 104, outside the model's vocab"),
        (["eval.sampling.stop=['']"], "eval.sampling.stop: holds an empty string"),
        (["train.optimizer.lr=-1e-5"], "train.optimizer.lr=-1e-05: must be > 0"),
        (["train.optimizer.min_lr=1e-3"], "train.optimizer.min_lr=0.001: must not exceed train.optimizer.lr"),
        (
            ["train.optimizer.cpu_offload=true", "parallel.use_distributed_optimizer=false"],
            "train.optimizer.cpu_offload=true: needs parallel.use_distributed_optimizer=true",
        ),
        (["train.global_batch_size=0"], "train.global_batch_size=0: must be >= 1"),
        (["train.max_tokens_per_gpu=-5"], "train.max_tokens_per_gpu=-5: must be >= 1 tokens"),
        (
            ["algorithm.loss=sft", "train.global_batch_size=6"],
            "train.global_batch_size=6: SFT steps of 6 samples must split evenly over 4 data-parallel",
        ),
        (["algorithm.loss=sft", "cluster.gpus_per_node=3"], "over 3 data-parallel ranks (null means 32)"),
        (
            ["train.global_batch_size=16"],
            "train.global_batch_size=16: in RL each optimizer step takes rollout_batch_size * "
            "n_samples_per_prompt / steps_per_rollout = 32 samples",
        ),
        (
            ["train.steps_per_rollout=3"],
            "32 samples must split evenly over 4 data-parallel ranks x 3 optimizer steps",
        ),
        (["model.ref_load=."], "model.ref_load=/"),  # no KL term: the reference would be unused
        (
            ["cluster.device=cuda"],
            "rollout.weight_sync=tensor (auto): a GPU trainer would send CUDA IPC handles, which the "
            "embedded engine (CPU) cannot receive",
        ),
        (["rollout.reward_type=remote"], "rollout.reward_type=remote: set rollout.remote_rm_url"),
        (
            ["rollout.reward_type=remote", "rollout.remote_rm_url=localhost:8000/score"],
            "rollout.remote_rm_url=localhost:8000/score: not an http(s) URL",
        ),
        (
            ["rollout.reward_type=remote", "rollout.remote_rm_url=http://rm:99999/score"],
            "rollout.remote_rm_url=http://rm:99999/score: not an http(s) URL",
        ),
        (
            ["rollout.remote_rm_url=http://rm:8000/score"],
            "rollout.remote_rm_url=http://rm:8000/score: read only with rollout.reward_type=remote",
        ),
        (
            ["rollout.group_rm=true"],
            "rollout.group_rm=true: applies to the reward hook rollout.custom_rm_path",
        ),
        (
            ["rollout.custom_rm_path=no_such_module.reward"],
            "rollout.custom_rm_path=no_such_module.reward: cannot import module `no_such_module`",
        ),
        (
            ["rollout.custom_generate_function_path=examples.custom_reward.reward"],
            "rollout.custom_generate_function_path=examples.custom_reward.reward: signature",
        ),
    ],
    ids=lambda v: v[-1] if isinstance(v, list) else None,
)
def test_cross_field_values_are_refused_at_load(moe, overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, _base(moe, *overrides))
    message = str(info.value)
    assert fragment in message and "\n" not in message, message


@pytest.mark.parametrize(
    ("name", "text", "extra", "fragment"),
    [
        ("empty.jsonl", "", [], "data.prompt_data={path}: holds no records (empty file)"),
        ("blank.jsonl", "\n\n", [], "holds no records"),
        ("bad.jsonl", '{"prompt": "1+1="}\nnot json\n', [], "{path}:2: not valid JSON"),
        ("array.json", '[{"prompt": "1+1="}]\n', [], "{path}:1: a JSON list, not an object; expected JSONL"),
        (
            "keys.jsonl",
            '{"question": "1+1=", "label": "2"}\n',
            [],
            "data.input_key=prompt: data.prompt_data={path}: record 1 has no `prompt` "
            "(its keys: label, question)",
        ),
        (
            "nolabel.jsonl",
            '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2="}\n',
            [],
            "data.label_key=label: data.prompt_data={path}: record 2 has no `label` "
            "(the built-in `toy` reward",
        ),
        ("sftnolabel.jsonl", '{"prompt": "1+1="}\n', ["algorithm.loss=sft"], "(SFT trains on it"),
        (
            "chat.jsonl",
            '{"prompt": [{"role": "user", "content": "1+1="}], "label": "2"}\n',
            [],
            "record 1: `prompt` holds chat messages; they need data.apply_chat_template=true",
        ),
        (
            "number.jsonl",
            '{"prompt": 12, "label": "2"}\n',
            [],
            "record 1: `prompt` is a int; expected a string",
        ),
        ("dir", None, [], "data.prompt_data={path}: file not found"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.count(".") == 1 else None,
)
def test_data_files_are_checked_at_load_from_their_first_records(moe, tmp_path, name, text, extra, fragment):
    path = tmp_path / name
    if text is None:
        path = tmp_path / "no_such.jsonl"
    else:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(None, _base(moe, f"data.prompt_data={path}", *extra))
    message = str(info.value)
    assert fragment.format(path=path) in message and "\n" not in message, message


def test_cross_field_checks_pass_for_what_the_run_accepts(moe):
    load_config(None, _base(moe, "cluster.device=cuda", "rollout.weight_sync=disk"))  # embedded engine
    load_config(None, _base(moe, "cluster.device=cuda", "algorithm.loss=sft"))  # no engines
    load_config(None, _base(moe, "train.global_batch_size=32"))  # the derived value, as a check
    load_config(None, _base(moe, "algorithm.kl_loss_coef=0.1", "model.ref_load=."))
    load_config(
        None, _base(moe, "rollout.reward_type=remote", "rollout.remote_rm_url=https://rm:8443/v1/score")
    )
    load_config(
        None, _base(moe, "rollout.custom_rm_path=examples.custom_reward.reward", "rollout.group_rm=false")
    )


def test_data_checks_pass_for_what_the_run_accepts(moe, tmp_path, mod_sum_data):
    chat = _data(tmp_path, "chat.jsonl", '{"prompt": [{"role": "user", "content": "1+1="}], "label": "2"}\n')
    load_config(None, _base(moe, f"data.prompt_data={chat}", "data.apply_chat_template=true"))
    unlabelled = _data(tmp_path, "u.jsonl", '{"prompt": "1+1="}\n')  # rewards come from elsewhere
    load_config(None, _base(moe, f"data.prompt_data={unlabelled}", "rollout.reward_type=none"))
    load_config(None, _base(moe, f"data.prompt_data={mod_sum_data}", f"eval.datasets.heldout={mod_sum_data}"))
    bad_eval = _data(tmp_path, "e.jsonl", "")
    with pytest.raises(ConfigError, match=r"^eval.datasets.heldout=.*holds no records"):
        load_config(None, _base(moe, f"eval.datasets.heldout={bad_eval}"))


def test_parquet_data_is_checked_from_its_first_rows(moe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["1+1="], "label": ["2"]}), path)
    with pytest.raises(ConfigError, match="record 1 has no `prompt`"):
        load_config(None, _base(moe, f"data.prompt_data={path}"))
    load_config(None, _base(moe, f"data.prompt_data={path}", "data.input_key=question"))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        load_config(None, _base(moe, f"data.prompt_data={tmp_path / 'fake.parquet'}"))


def test_what_only_a_run_needs_is_checked_before_it_creates_anything(moe, tmp_path):
    """`check_run_inputs`: `--dry-run` and `slimrl plan` need neither data nor weights."""
    with pytest.raises(ConfigError, match=r"^data.prompt_data=null: rollouts draw from a prompt data set"):
        check_run_inputs(load_config(None, _base(moe)))
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    shutil.copy(moe / "config.json", shapes / "config.json")
    data = _data(tmp_path, "d.jsonl", '{"prompt": "1+1=", "label": "2"}\n')
    config = load_config(None, _base(shapes, f"data.prompt_data={data}"))  # loads: shapes are enough
    with pytest.raises(ConfigError, match=r"model.hf_checkpoint=.*shapes: no \*.safetensors weights"):
        check_run_inputs(config)
    sft = load_config(
        None, _base(shapes, f"data.prompt_data={data}", "algorithm.loss=sft", "model.init_from_hf=false")
    )
    check_run_inputs(sft)  # SFT from random weights needs no weights file


# --- finalize and resolved.yaml -------------------------------------------------------------------


def test_finalize_derives_every_value_once_and_resolved_yaml_loads_back(moe, mod_sum_data, tmp_path):
    config = load_config(
        REPO / "configs" / "tiny_moe_grpo_cpu.yaml",
        [f"model.hf_checkpoint={moe}", f"data.prompt_data={mod_sum_data}", f"run.runs_dir={tmp_path}",
         "train.steps_per_rollout=2", "algorithm.loss_reduction=seq_mean_token_sum_norm"],
    )  # fmt: skip
    resolved = finalize(config)
    assert (resolved.cluster.device, resolved.model.dtype) == ("cpu", "fp32")
    assert (resolved.parallel.dp, resolved.parallel.etp, resolved.parallel.sequence_parallel) == (2, 1, False)
    assert resolved.rollout.weight_sync == "tensor" and resolved.rollout.over_sampling_batch_size == 64
    assert resolved.train.global_batch_size == 64 * 16 // 2  # samples per optimizer step
    assert resolved.train.lr_schedule.decay_steps == 330 * 2 and resolved.train.offload is False
    assert resolved.algorithm.eps_clip_high == 0.2 and resolved.algorithm.loss_norm_tokens == 1
    assert resolved.checkpoint.save_dir == str(tmp_path / "tiny_moe_grpo" / "checkpoints")
    assert config.rollout.weight_sync == "auto" and config.train.global_batch_size is None  # a copy
    assert finalize(resolved) == resolved
    assert load_config(save_config(resolved, tmp_path / "resolved.yaml")) == resolved
    # a clean clone has no data/: name the data set
    sft_overrides = [f"model.hf_checkpoint={moe}", f"data.prompt_data={mod_sum_data}"]
    sft = finalize(load_config(REPO / "configs" / "tiny_moe_cpu.yaml", sft_overrides))
    assert sft.train.global_batch_size == 32 and sft.train.offload is None


def test_run_dir_gets_config_and_resolved_yaml_without_secrets(moe, tmp_path):
    from slimrl.orchestration.entry import prepare_run_dir

    config = load_config(
        None, _base(moe, f"run.runs_dir={tmp_path}", "run.name=r", "rollout.api_key=sekrit-api-key")
    )
    run_dir, resolved = prepare_run_dir(config)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "resolved.yaml"]
    for name in ("config.yaml", "resolved.yaml"):
        text = (run_dir / name).read_text()
        assert "sekrit" not in text and text.startswith("# rollout.api_key: not written (secret)")
    assert resolved.rollout.api_key == "sekrit-api-key" and resolved.rollout.admin_api_key  # drawn, unsaved
    assert resolved.rollout.admin_api_key not in (run_dir / "resolved.yaml").read_text()
    assert load_config(run_dir / "resolved.yaml").parallel.dp == 4
