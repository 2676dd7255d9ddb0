"""Every shipped GPU config gets past step 0 or is refused at load: the engines' memory plan, a
checkpoint's own tokenizer code (`model.trust_remote_code`), the trainer environment of true
on-policy, and the FP8 start checkpoint the engines load. Fast: no Ray, no servers."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from slimrl.config import load_config
from slimrl.errors import ConfigError
from tests.conftest import REPO, run_slimrl
from tests.test_launch_plan import GPU_CONFIGS


def _one_line_exit_2(*args: str) -> str:
    proc = run_slimrl(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ---------------------------------------------------------------- trust_remote_code


def test_every_tokenizer_or_config_load_passes_trust_remote_code():
    """Every `AutoTokenizer/AutoConfig/AutoModelForCausalLM.from_pretrained` under slimrl/ names
    trust_remote_code, except the converter's HF reference model, whose model types are the bridge's
    own (transformers-native) ones and which loads no tokenizer."""
    missing = []
    for path in sorted((REPO / "slimrl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "from_pretrained" or not isinstance(node.func.value, ast.Name):
                continue
            owner = node.func.value.id
            if path.name == "convert.py" and owner == "AutoModelForCausalLM":
                continue
            if "trust_remote_code" not in {k.arg for k in node.keywords}:
                missing.append(f"{path.relative_to(REPO)}:{node.lineno} {owner}")
    assert missing == []


@pytest.fixture(scope="module")
def remote_tokenizer_model(tiny_model, tmp_path_factory) -> Path:
    """A tiny checkpoint whose tokenizer is code shipped with it, the way Moonlight's is."""
    out = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(tiny_model("qwen3_moe"), out)
    (out / "tokenization_tiny.py").write_text(  # a visible difference: every text is 1000 tokens
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class TinyRemoteTokenizer(PreTrainedTokenizerFast):\n"
        "    def encode(self, text, **kwargs):\n        return [0] * 1000\n"
    )
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyRemoteTokenizer"]}
    tokenizer_config.pop("tokenizer_class", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


def test_a_checkpoint_with_tokenizer_code_is_refused_without_trust_remote_code(
    remote_tokenizer_model, mod_sum_data
):
    base = [f"model.hf_checkpoint={remote_tokenizer_model}", f"data.prompt_data={mod_sum_data}"]
    with pytest.raises(ConfigError) as refused:
        load_config(REPO / "configs/tiny_moe_grpo_cpu.yaml", base)
    line = str(refused.value)
    assert line.startswith("model.trust_remote_code=false: ") and "\n" not in line
    assert "tokenizer_config.json maps AutoTokenizer to tokenization_tiny.TinyRemoteTokenizer" in line
    config = load_config(REPO / "configs/tiny_moe_grpo_cpu.yaml", [*base, "model.trust_remote_code=true"])
    # the flag reaches transformers: the prompt filter loads the checkpoint's own tokenizer class
    from slimrl.rollout.data_source import DataSource

    config.data.max_prompt_tokens, config.data.apply_chat_template = 64, False
    with pytest.raises(ConfigError, match="every one of the 512 prompts"):
        DataSource(config)  # the checkpoint's own tokenizer counted them (1000 tokens each)
    # what the load check stands in front of: transformers 5 silently falls back to another tokenizer
    config.model.trust_remote_code = False
    assert len(DataSource(config).records) == 512


def test_moonlight_ships_its_tokenizer_auto_map_and_trusts_it():
    path = REPO / "configs/moonlight_16b_a3b_8gpu.yaml"
    config = load_config(path)
    assert config.model.trust_remote_code is True
    stub = json.loads((REPO / config.model.hf_checkpoint / "tokenizer_config.json").read_text())
    assert stub == {"auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]}}
    shipped = str(path.relative_to(REPO))
    line = _one_line_exit_2("train", shipped, "model.trust_remote_code=false", "--dry-run")
    assert line.startswith("slimrl: error: model.trust_remote_code=false: ")
    assert "moonlight_16b_a3b/tokenizer_config.json maps AutoTokenizer to tokenization_moonshot" in line
    proc = run_slimrl("train", shipped, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    for engine in json.loads(proc.stdout)["engines"]:
        assert "--trust-remote-code" in engine["command"]
    for other in GPU_CONFIGS:
        if other != path:
            assert load_config(other).model.trust_remote_code is False


# ---------------------------------------------------------------- true on-policy trainer environment

DETERMINISTIC = {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",  # Transformer Engine: deterministic kernels only
    "NCCL_ALGO": "allreduce:tree",  # what SGLang picks for deterministic inference with TP > 1
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # reproducible cuBLAS GEMMs (CUDA >= 10.2)
}


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_true_on_policy_trainer_ranks_get_the_determinism_environment(path):
    shipped = str(path.relative_to(REPO))
    for on_policy, want in (("true", DETERMINISTIC), ("false", {})):
        proc = run_slimrl("train", shipped, f"algorithm.true_on_policy={on_policy}", "--dry-run", "--json")
        assert proc.returncode == 0, proc.stderr
        env = json.loads(proc.stdout)["trainer_env"]
        assert {k: env[k] for k in DETERMINISTIC if k in env} == want
        assert env["TOKENIZERS_PARALLELISM"] == "false"  # the job-wide environment is shown too
    text = run_slimrl("train", shipped, "algorithm.true_on_policy=true", "--dry-run").stdout
    training = text.split("weight sync:")[0]
    assert "  env NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in training.splitlines()


def test_trainer_actors_carry_the_environment_and_cpu_ranks_do_not():
    from slimrl.orchestration.placement import DeviceSlots, trainer_actor_options, trainer_env

    config = load_config(GPU_CONFIGS[0], ["algorithm.true_on_policy=true"])
    assert trainer_env(config, "cuda") == DETERMINISTIC
    assert trainer_env(config, "cpu") == {}  # gloo and fp32 on CPU: exact already, no TE
    config.algorithm.true_on_policy = False
    assert trainer_env(config, "cuda") == {}
    slots = DeviceSlots(placement_group=None, ordered_bundles=[3, 2, 1, 0], use_gpu=True)
    options = trainer_actor_options(slots, 1, 0.5, DETERMINISTIC)
    assert options["runtime_env"] == {"env_vars": DETERMINISTIC}  # Ray merges it into the job's
    assert options["num_gpus"] == 0.5 and options["scheduling_strategy"].placement_group_bundle_index == 2
    assert "runtime_env" not in trainer_actor_options(slots, 1, 0.5, {})
