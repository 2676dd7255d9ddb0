"""Every shipped GPU config gets past step 0 or is refused at load: the engines' memory plan, a
checkpoint's own tokenizer code (`model.trust_remote_code`), the trainer environment of true
on-policy, and the FP8 start checkpoint the engines load. Fast: no Ray, no servers."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from slimrl.errors import ConfigError
from slimrl.preflight import load_config
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


# ---------------------------------------------------------------- engine memory plan
# Expected bytes per GPU from the definition, written out here from each config.json: SGLang's
# sharding (attention over tp / dp, experts E / ep each over tp / ep, dense and shared MLPs and
# lm_head over tp, the embedding over attention tp, vocab padded to 64 * tp), the FP8 checkpoint
# format (1 B per element + one fp32 scale per 128x128 block for the decoder's linear weights, bf16
# elsewhere), MLA's bf16 w_kc/w_vc copy of kv_b_proj, and SGLang 0.5.23's reserve
# (arg_groups/memory_hook.py: 512 + 1.5 x max(chunked prefill, 2048) + tp/8 x 1024 + 2 x decode
# max_bs [+ max_bs x dp x 3, + max_bs x dp x 1.5 above 300] MiB, at least 10 GiB above 60 GiB GPUs).
GiB, MiB = 1024**3, 1024**2


def lin(rows: int, cols: int, fp8: bool) -> int:
    return rows * cols + 4 * -(-rows // 128) * -(-cols // 128) if fp8 else 2 * rows * cols


def swiglu(ffn: int, hidden: int, fp8: bool) -> int:
    return 2 * lin(ffn, hidden, fp8) + lin(hidden, ffn, fp8)


def deepseek_v3_fp8_tp8_ep8_dp8() -> int:
    h, layers, moe = 7168, 61, 58
    attention = (
        lin(1536, h, True) + lin(128 * 192, 1536, True) + lin(576, h, True)  # q_a, q_b, kv_a (whole)
        + lin(128 * 256, 512, True) + lin(h, 128 * 128, True) + 2 * (1536 + 512)  # kv_b, o, 2 norms
    )  # fmt: skip
    experts = 32 * swiglu(2048, h, True)  # 256 / ep 8, expert tp 1
    shared, dense = swiglu(2048 // 8, h, True), swiglu(18432 // 8, h, True)
    router = 256 * h * 2 + 256 * 4  # bf16 gate, fp32 e_score_correction_bias
    norms = (2 * layers + 1) * h * 2
    vocab = 129280 * h * 2 + 129280 // 8 * h * 2  # embedding whole (attention tp 1), lm_head / 8
    mla_copies = layers * 128 * 256 * 512 * 2
    return layers * attention + moe * (experts + shared + router) + 3 * dense + norms + vocab + mla_copies


def qwen3_235b_fp8_tp8_ep8() -> int:
    h, layers = 4096, 94
    attention = lin(1024, h, True) + 2 * lin(128, h, True) + lin(h, 1024, True) + 2 * 128 * 2
    experts = 16 * swiglu(1536, h, True)  # 128 / ep 8
    router, norms = 128 * h * 2, (2 * layers + 1) * h * 2
    return layers * (attention + experts + router) + norms + 2 * (151936 // 8) * h * 2


def qwen3_30b_bf16_tp2() -> int:
    h, layers = 2048, 48
    attention = lin(16 * 128 + 2 * 2 * 128, h, False) + lin(h, 16 * 128, False) + 2 * 128 * 2
    experts = 128 * swiglu(768 // 2, h, False)  # ep 1: every expert, split over tp 2
    router, norms = 128 * h * 2, (2 * layers + 1) * h * 2
    return layers * (attention + experts + router) + norms + 2 * (151936 // 2) * h * 2


def moonlight_bf16_tp2() -> int:
    h, layers = 2048, 27
    attention = (
        lin(8 * 192, h, False) + lin(576, h, False) + lin(8 * 256, 512, False) + lin(h, 8 * 128, False)
        + 512 * 2  # kv_a_layernorm
    )  # fmt: skip
    moe = 64 * swiglu(1408 // 2, h, False) + swiglu(2 * 1408 // 2, h, False) + 64 * h * 2 + 64 * 4
    norms = (2 * layers + 1) * h * 2
    return (
        layers * attention + 26 * moe + swiglu(11264 // 2, h, False) + norms
        + 2 * (163840 // 2) * h * 2 + layers * 8 * 256 * 512 * 2  # vocab; w_kc/w_vc
    )  # fmt: skip


SEQUENCE = 2048 + 8192  # data.max_prompt_tokens + rollout.sampling.max_new_tokens (gpu_moe.yaml)
ENGINES = {  # config -> (weights, KV bytes per token per GPU, SGLang's reserve in MiB, GPU GiB)
    "deepseek_v3_256gpu": (deepseek_v3_fp8_tp8_ep8_dp8(), (512 + 64) * 61 * 2,
                           512 + 8192 * 1.5 + 1024 + 512 * 2 + 512 * 8 * 3 + 512 * 8 * 1.5, 141),
    "grpo_moe_256gpu": (qwen3_235b_fp8_tp8_ep8(), 2 * 94 * 1 * 128 * 2,  # 4 kv heads < tp 8: one each
                        512 + 8192 * 1.5 + 1024 + 512 * 2, 80),
    "qwen3_30b_a3b_8gpu": (qwen3_30b_bf16_tp2(), 2 * 48 * 2 * 128 * 2,  # 2 kv heads per GPU
                           512 + 8192 * 1.5 + 256 + 256 * 2, 80),
    "moonlight_16b_a3b_8gpu": (moonlight_bf16_tp2(), (512 + 64) * 27 * 2,
                               512 + 8192 * 1.5 + 256 + 256 * 2, 80),
}  # fmt: skip


def _printed(stdout: str, term: str) -> float:
    line = next(line for line in stdout.splitlines() if line.startswith(term))
    return float(line[len(term) :].split()[0])


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_gpu_config_engine_fits_by_the_plan(path, monkeypatch):
    from slimrl.planning.engine_plan import plan_engine

    monkeypatch.chdir(REPO)
    weights, kv_per_token, reserve_mib, gpu_gib = ENGINES[path.stem]
    config = load_config(path)  # the engine check ran at load
    assert config.cluster.gpu_memory_gb == gpu_gib
    engine = plan_engine(config)
    assert engine.weight_bytes == weights
    assert (engine.kv_per_token, engine.sequence_tokens) == (kv_per_token, SEQUENCE)
    assert engine.reserve == int(reserve_mib * MiB)
    static = int(config.rollout.sglang.mem_fraction_static * gpu_gib * GiB)
    assert static - weights >= SEQUENCE * kv_per_token and gpu_gib * GiB - static >= reserve_mib * MiB
    assert engine.fits
    proc = run_slimrl("plan", str(path.relative_to(REPO)))
    assert proc.returncode == 0, proc.stderr
    for term, value in (
        ("weights", weights),
        ("KV, one sequence", SEQUENCE * kv_per_token),
        ("CUDA graphs + activations", reserve_mib * MiB),
        ("total needed", weights + SEQUENCE * kv_per_token + reserve_mib * MiB),
    ):
        assert _printed(proc.stdout, term) == round(value / GiB, 2), term
    assert "total needed" in proc.stdout and proc.stdout.rstrip().endswith("fits")


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["configs/deepseek_v3_256gpu.yaml", "cluster.gpu_memory_gb=80"],
         ["rollout.gpus_per_engine=8: weights 91.26 GiB + KV of one 10240-token sequence 0.67 GiB + CUDA "
          "graphs/activations 32.50 GiB (SGLang's estimate) = 124.43 GiB per GPU, above the 80.00 GiB",
          "an engine does not fit one node of 8 GPUs, and slimrl's launcher does not start engines spanning "
          "nodes", "cluster.gpu_memory_gb=141"]),
        (["configs/deepseek_v3_256gpu.yaml", "cluster.gpu_memory_gb=80", "rollout.gpus_per_engine=4",
          "rollout.sglang.ep_size=4"],
         ["rollout.gpus_per_engine=4: weights 168.06 GiB", "= 191.73 GiB per GPU, above the 80.00 GiB",
          "does not fit one node of 8 GPUs (all 8 in one engine: 124.43 GiB per GPU)"]),
        (["configs/deepseek_v3_256gpu.yaml", "rollout.sglang.mem_fraction_static=0.85"],
         ["rollout.sglang.mem_fraction_static=0.85: leaves 21.15 GiB per GPU outside SGLang's static pool, "
          "below the 32.50 GiB", "lower it into 0.652..0.769"]),
        (["configs/qwen3_30b_a3b_8gpu.yaml", "rollout.gpus_per_engine=1"],
         ["rollout.sglang.mem_fraction_static=0.7: SGLang's static pool of 56.00 GiB per GPU must hold "
          "weights 56.87 GiB", "raise it into 0.723..0.835"]),
        (["configs/qwen3_30b_a3b_8gpu.yaml", "rollout.gpus_per_engine=1", "cluster.gpu_memory_gb=64"],
         ["rollout.gpus_per_engine=1: weights 56.87 GiB", "above the 64.00 GiB of one GPU",
          "use more GPUs per engine (rollout.gpus_per_engine=8: 21.89 GiB per GPU), "
          "rollout.sglang.quantization=fp8"]),
        (["configs/grpo_moe_256gpu.yaml", "rollout.sglang.ep_size=1"],
         ["rollout.sglang.quantization=fp8: model.layers.0.mlp.experts.0.gate_proj.weight has 192 rows per "
          "GPU (tp 8, ep 1), not a multiple of SGLang's 128-wide FP8 blocks"]),
        (["configs/grpo_moe_256gpu.yaml", "rollout.sglang.ep_size=8", "rollout.gpus_per_engine=8",
          "rollout.sglang.extra_args={kv_cache_dtype: fp4}"],
         ["rollout.sglang.extra_args.kv_cache_dtype=fp4: the engine plan knows auto"]),
    ],
)  # fmt: skip
def test_engines_that_cannot_fit_are_refused_at_load_in_one_line(overrides, fragments):
    for command in (["train", *overrides, "--dry-run"], ["plan", *overrides]):
        line = _one_line_exit_2(*command)
        assert line.startswith("slimrl: error: " + fragments[0].split(":")[0])
        for fragment in fragments:
            assert fragment in line, line


def test_the_engine_plan_does_not_apply_on_cpu(tiny_model, mod_sum_data):
    base = [f"model.hf_checkpoint={tiny_model('qwen3_moe')}", f"data.prompt_data={mod_sum_data}"]
    tiny = "configs/tiny_moe_grpo_cpu.yaml"
    load_config(REPO / tiny, [*base, "rollout.engine=sglang", "cluster.gpu_memory_gb=0.001"])
    proc = run_slimrl("plan", tiny, *base, "rollout.engine=sglang")
    assert proc.returncode == 0 and "engine term" not in proc.stdout, proc.stderr


TINY_ARCHS = [("qwen3_moe", {}), ("qwen3", {}), ("qwen2", {}), ("llama", {}), ("deepseek_v3", {}),
              ("deepseek_v3", {"q_lora_rank": 16})]  # fmt: skip


@pytest.mark.parametrize(("arch_name", "overrides"), TINY_ARCHS, ids=lambda v: str(v))
def test_engine_tensors_at_tp1_are_the_checkpoint_and_its_fp8_copy(
    tiny_model, tmp_path, arch_name, overrides
):
    """At tp 1 an engine holds every checkpoint tensor (vocab rows padded to 64), and with FP8 the
    bytes of `weight_sync/fp8.py`'s start checkpoint: the plan counts what the format writes."""
    from slimrl.megatron_bridge.archs import read_model_arch
    from slimrl.megatron_bridge.hf_io import HFCheckpointReader
    from slimrl.planning.engine_plan import EngineTensor, EngineWidths, hf_tensors, tensor_bytes
    from slimrl.weight_sync.fp8 import write_fp8_checkpoint

    source = tiny_model(arch_name, **overrides)
    arch = read_model_arch(source)
    one = EngineWidths(tp=1, attn_dp=1, attn_tp=1, moe_ep=1, moe_tp=1, embed_tp=1, head_tp=1)
    planned = {t.name: t for t in hf_tensors(arch, one)}
    reader = HFCheckpointReader(source)
    padded = -(-arch.vocab_size // 64) * 64
    for name in reader.names:
        shape = reader.shape(name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shape = (padded, *shape[1:])
        assert planned[name].shape == shape, name
    assert set(planned) == set(reader.names)
    fp8 = HFCheckpointReader(write_fp8_checkpoint(source, tmp_path / "fp8"))
    for name in reader.names:
        shape = reader.shape(name)
        tensor = EngineTensor(name, shape, "", fp32=planned[name].fp32)
        written = fp8.nbytes(name) + (
            fp8.nbytes(name + "_scale_inv") if name + "_scale_inv" in fp8.names else 0
        )
        if fp8.get(name).dtype != torch.float8_e4m3fn:  # kept: served in bf16 (fp32 where SGLang keeps it)
            written = fp8.get(name).numel() * (4 if planned[name].fp32 else 2)
        assert tensor_bytes(tensor, fp8=True) == written, name


# ---------------------------------------------------------------- the FP8 start checkpoint


def _single_process_fp8(src: Path, dst: Path) -> Path:
    """The start checkpoint as the single-process writer made it before it went parallel: every
    tensor in checkpoint order through one ShardWriter, then the index."""
    from slimrl.megatron_bridge.hf_io import HFCheckpointReader, ShardWriter, finalize_index
    from slimrl.weight_sync.fp8 import fp8_bucket

    dst.mkdir()
    reader, writer = HFCheckpointReader(src), ShardWriter(dst)
    for name in reader.names:
        for out_name, tensor in fp8_bucket([(name, reader.get(name))]):
            writer.add(out_name, tensor)
    writer.flush()
    finalize_index(dst, writer.files, writer.bytes_written)
    return dst


@pytest.fixture(scope="module")
def sharded_model(tiny_model, tmp_path_factory) -> Path:
    """A tiny checkpoint in 4 safetensors files of unequal sizes, with tokenizer and config."""
    from slimrl.megatron_bridge.hf_io import INDEX_NAME, HFCheckpointReader, ShardWriter, finalize_index

    source = tiny_model("qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
    out = tmp_path_factory.mktemp("sharded") / "model"
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX_NAME))
    reader = HFCheckpointReader(source)
    writer = ShardWriter(out, max_shard_bytes=reader.total_bytes() // 10)  # fp32 source, bf16 copy
    for name in reader.names:
        writer.add(name, reader.get(name).to(torch.bfloat16))  # as a real bf16 checkpoint
    writer.flush()
    finalize_index(out, writer.files, writer.bytes_written)
    assert len(set(HFCheckpointReader(out).location.values())) >= 4
    return out


def test_parallel_fp8_start_checkpoint_has_the_single_process_bytes(sharded_model, tmp_path):
    from slimrl.megatron_bridge.hf_io import HFCheckpointReader
    from slimrl.orchestration.fp8_start import local_pool_map
    from slimrl.weight_sync.fp8 import fp8_hf_config, split_source_files, write_fp8_checkpoint

    groups = split_source_files(sharded_model, 2)
    files = sorted(set(HFCheckpointReader(sharded_model).location.values()))
    assert len(groups) == 2 and sorted(f for g in groups for f in g) == files
    reference = HFCheckpointReader(_single_process_fp8(sharded_model, tmp_path / "single"))
    parallel = write_fp8_checkpoint(sharded_model, tmp_path / "parallel", parts=2, map_parts=local_pool_map)
    got = HFCheckpointReader(parallel)
    assert len(set(got.location.values())) >= 2  # each worker wrote shards of its own
    assert got.names != [] and sorted(got.names) == sorted(reference.names)
    for name in reference.names:
        want, have = reference.get(name), got.get(name)
        assert (have.dtype, have.shape) == (want.dtype, want.shape), name
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8)), name
    index = json.loads((parallel / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(reference.nbytes(n) for n in reference.names)
    for side in ("tokenizer.json", "tokenizer_config.json"):
        assert (parallel / side).read_bytes() == (sharded_model / side).read_bytes()
    source_config = json.loads((sharded_model / "config.json").read_text())
    assert json.loads((parallel / "config.json").read_text()) == fp8_hf_config(source_config)


def test_the_start_checkpoint_is_atomic_and_written_once(sharded_model, tmp_path, monkeypatch):
    from slimrl.config.schema import SlimConfig
    from slimrl.orchestration import fp8_start

    config = SlimConfig()
    config.model.hf_checkpoint = str(sharded_model)
    config.rollout.sglang.quantization = "fp8"

    def dies(write, calls):
        write(*calls[0])  # one worker's shards land, then the run is killed
        raise KeyboardInterrupt

    monkeypatch.setattr(fp8_start, "local_pool_map", dies)
    with pytest.raises(KeyboardInterrupt):
        fp8_start.serving_checkpoint(config, tmp_path)
    assert not (tmp_path / "fp8_start").exists() and (tmp_path / "fp8_start.partial").exists()
    monkeypatch.undo()
    monkeypatch.setattr(fp8_start.os, "cpu_count", lambda: 1)  # one worker, in this process: fast
    start = Path(fp8_start.serving_checkpoint(config, tmp_path))
    assert start == tmp_path / "fp8_start" and not (tmp_path / "fp8_start.partial").exists()
    written = (start / "config.json").stat().st_mtime_ns
    assert fp8_start.serving_checkpoint(config, tmp_path) == str(start)  # reused, not rewritten
    assert (start / "config.json").stat().st_mtime_ns == written


def test_ray_writers_run_on_training_slots_spread_over_nodes(monkeypatch):
    import ray

    from slimrl.devices.launch_plan import Slot
    from slimrl.orchestration.fp8_start import WRITER_CPUS, ray_map, spread_slots
    from slimrl.orchestration.placement import DeviceSlots

    layout = [Slot("a", 0), Slot("a", 1), Slot("a", 2), Slot("b", 0), Slot("b", 1), Slot("b", 2)]
    assert spread_slots(layout, 4) == [0, 3, 1, 4]
    assert spread_slots(layout[:2], 3) == [0, 1, 0]
    launched = []

    class FakeTask:  # Ray's shape: `.options()` once, then `.remote()` (no second `.options()`)
        def __init__(self, fn):
            self.fn = fn

        def options(self, **options):
            fn = self.fn
            launched.append(options)
            return type("Wrapper", (), {"remote": staticmethod(lambda *args: fn(*args))})()

    monkeypatch.setattr(ray, "remote", FakeTask)
    monkeypatch.setattr(ray, "get", lambda futures: futures)
    slots = DeviceSlots(placement_group=None, ordered_bundles=[5, 4, 3, 2, 1, 0], use_gpu=True, layout=layout)
    out = ray_map(slots, train_slots=4)(lambda part: ([(f"p{part}", [])], part), [(0,), (1,), (2,)])
    assert out == [([("p0", [])], 0), ([("p1", [])], 1), ([("p2", [])], 2)]
    # training slots 0..3 are a0 a1 a2 b0: the writers go to a0, b0, a1
    assert [o["scheduling_strategy"].placement_group_bundle_index for o in launched] == [5, 2, 4]
    assert all(o["num_cpus"] == WRITER_CPUS and o["num_gpus"] == 0 for o in launched)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_dry_run_shows_the_checkpoint_the_engines_load(path):
    config = load_config(path)
    shipped = str(path.relative_to(REPO))
    proc = run_slimrl("train", shipped, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    paths = {e["command"][e["command"].index("--model-path") + 1] for e in report["engines"]}
    if config.rollout.sglang.quantization == "fp8":
        start = str(Path(config.run.runs_dir) / config.run.name / "fp8_start")
        assert paths == {start} and report["fp8_start"]["path"] == start
        assert report["fp8_start"]["from"] == config.model.hf_checkpoint
        assert report["fp8_start"]["written"].startswith("at start")
        text = run_slimrl("train", shipped, "--dry-run").stdout
        assert f"fp8 start checkpoint: {start} (every engine's --model-path)" in text
        assert "written at start, before the engines load" in text
    else:
        assert paths == {config.model.hf_checkpoint} and "fp8_start" not in report


@pytest.mark.slow
def test_ray_writers_make_the_same_start_checkpoint(sharded_model, tmp_path):
    """Real Ray on this machine, one CPU slot per training rank: the writer tasks land on their
    slots and write the single-process bytes."""
    import ray

    from slimrl.megatron_bridge.hf_io import HFCheckpointReader
    from slimrl.orchestration.fp8_start import ray_map
    from slimrl.orchestration.placement import create_device_slots, worker_env
    from slimrl.weight_sync.fp8 import write_fp8_checkpoint

    reference = HFCheckpointReader(_single_process_fp8(sharded_model, tmp_path / "single"))
    env = {"env_vars": worker_env("cpu")}
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=env)
    try:
        slots = create_device_slots(4, use_gpu=False)
        written = write_fp8_checkpoint(sharded_model, tmp_path / "ray", parts=3, map_parts=ray_map(slots, 4))
    finally:
        ray.shutdown()
    got = HFCheckpointReader(written)
    assert len({f.split("-of-")[0] for f in got.location.values()}) >= 3
    assert sorted(got.names) == sorted(reference.names)
    for name in reference.names:
        assert torch.equal(got.get(name).view(torch.uint8), reference.get(name).view(torch.uint8)), name
