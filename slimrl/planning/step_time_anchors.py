"""Published RL step times, the rows the step-time model is checked against.

Every number in `published` is copied from the source named in the row's `source`; nothing here
comes from the model. Inputs a source does not state are assumptions, listed in the row's
`assumed`. `calibration` names the published phases a constant of `step_time.py` was fitted on
(those are not predictions); `excluded` gives the reason a row is shown but not checked.
`tests/test_step_time.py` holds every other phase within 25%, `bench/bench_step_time.py` prints
the table. docs/step_time.md tells where each number comes from.

Prompt lengths: NeMo-RL's performance pages give, per row, tokens per second per GPU over the
whole step (prompt and response tokens), the step time, the GPUs and the responses per step, so
tokens per response = tok/s/GPU x step x GPUs / responses; the prompt is that minus the mean
generated length the same row gives ("G-Average Seq len"). `_prompt` does this arithmetic on the
published numbers. The v0.3 blog gives no throughput: its rows take the mean of the same
dataset's derived prompts (OpenMathInstruct-2 with NeMo-RL's math prompt: ~130 tokens for Llama's
tokenizer, ~110 for Qwen's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.model_arch import ModelArch
from slimrl.parallel_layout import ParallelLayout
from slimrl.planning.gpus import gpu_spec
from slimrl.planning.step_time import ModelShape, StepSpec, TrainerSpec, Workload, model_shape, predict
from slimrl.planning.step_time_spec import VLLM_MAX_RUNNING, engine_spec, state_bytes, vllm_kv_room

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"

NEMO_V03 = "https://nvidia-nemo.github.io/blog/2025/07/21/nemo-rl-v0.3 (per-phase table, steps 22-29)"
NEMO_V05 = (
    "NVIDIA-NeMo/RL docs/about/performance-summary.md, NeMo RL v0.5 tables "
    "(commit 108bffdab, https://docs.nvidia.com/nemo/rl/0.5.0/about/performance-summary.html)"
)
NEMO_V06 = (
    "NVIDIA-NeMo/RL docs/about/performance-summary.md, NeMo RL v0.6 tables "
    "(commit 7ea279abf, https://docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html)"
)
NEMO_RERUN = (
    "https://github.com/NVIDIA-NeMo/RL/issues/959 (a user's rerun of the v0.3 blog's Megatron "
    "rows on their cluster: 8B and 70B)"
)
VERL_H20 = (
    "volcengine/verl docs/advance/fully_async.md, '30B Model Mode Experiment', colocate sync row "
    "(commit b178a3cd5)"
)

NEMO_PHASES = {
    "generation": ("generation",),
    "logprobs": ("policy_logprobs", "reference_logprobs"),
    "training": ("training",),
    "refit": ("weight_sync", "offload"),
}
"""NeMo-RL's timers: `refit` includes offloading the optimizer before and the weights after the
weight update (`offload_before_refit`/`offload_after_refit`); `logprobs` is the policy and the
reference pass together."""

VERL_PHASES = {
    "gen": ("generation", "weight_sync", "onload", "offload"),
    "old_log_prob": ("policy_logprobs", "onload", "offload"),
    "ref": ("reference_logprobs",),
    "update_actor": ("training", "onload", "offload"),
}
"""verl's timers (`param_offload=True`): each of the actor's three uses loads its parameters back
and offloads them again inside its own timer (the weight sync at the start of `gen`, the logprob
pass in `old_log_prob`, the update in `update_actor`)."""


@dataclass(frozen=True, kw_only=True)
class Anchor:
    key: str
    source: str
    framework: str
    """`nemo-rl` or `verl` (how its phases map onto the model's)."""
    model: str
    """Directory under configs/models."""
    gpu: str
    gpus: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    stage_layers: int | None = None
    """Decoder layers of the largest pipeline stage (uneven first/last stages)."""
    sequence_parallel: bool = False
    recompute: str | None = None
    engine_gpus: int = 1
    utilization: float = 0.6
    """vLLM `gpu_memory_utilization`."""
    samples: int = 2048
    prompt_tokens: float
    response_tokens: float
    max_sequence: int
    """`max_total_sequence_length`: the prompt and its response."""
    max_response: int | None = None
    micro_tokens: int | None = None
    """Tokens per training micro-batch (sequence packing: micro-batch size x max sequence)."""
    logprob_tokens: int | None = None
    micro_samples: int | None = None
    """No sequence packing: samples per training micro-batch, padded to the longest."""
    logprob_samples: int | None = None
    optimizer_steps: int = 4
    kl: bool = True
    max_running: int = VLLM_MAX_RUNNING
    cpu_optimizer: bool = False
    published: dict[str, float]
    calibration: tuple[str, ...] = ()
    unchecked: dict[str, str] = field(default_factory=dict)
    """Published phases shown but not checked, with the input the source leaves out."""
    solve_response_from: str | None = None
    """The row does not publish its mean response length: solve it from this published phase
    (which then is the row's calibration)."""
    assumed: tuple[str, ...] = field(default_factory=tuple)

    @property
    def phase_map(self) -> dict[str, tuple[str, ...]]:
        return NEMO_PHASES if self.framework == "nemo-rl" else VERL_PHASES


def _prompt(tokens_per_s_gpu: float, step_s: float, gpus: int, samples: int, generated: float) -> float:
    """Mean prompt tokens from a row's published throughput (module docstring)."""
    return tokens_per_s_gpu * step_s * gpus / samples - generated


LLAMA_PROMPT = 130.0
"""Mean of the Llama rows' derived prompts (v0.4 127-132, v0.5 127-128)."""
QWEN_PROMPT = 110.0
"""Mean of the Qwen rows' derived prompts (v0.5/v0.6: 99-121)."""

RERUN_REFIT = (
    "the rerun's cluster moves weights slower than the blog's, by a cause the issue does not name: "
    "all four refit times it reports (Megatron and DTensor, 8B and 70B) are 1.3-1.9x the blog's, "
    "while its generation and logprob phases are at most 1.11x the blog's"
)
"""Why the rerun's refit is shown but not checked (NeMo-RL #959's table, which also has the
DTensor rows: refit 4 -> 6 s and 15 -> 20 s beside Megatron's 5 -> 8 s and 14 -> 26 s)."""


V06_ON_POLICY: tuple[Anchor, ...] = (
    Anchor(
        key="nemo-v0.6 qwen3-30b-a3b 32xH100",
        source=NEMO_V06,
        framework="nemo-rl",
        model="qwen3_30b_a3b",
        gpu="H100",
        gpus=32,
        ep=8,
        engine_gpus=2,
        prompt_tokens=_prompt(1102, 192, 32, 2048, 3203),
        response_tokens=3203,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=4 * 4096,
        published={"step": 192},
    ),
    Anchor(
        key="nemo-v0.6 qwen3-235b 128xH100",
        source=NEMO_V06,
        framework="nemo-rl",
        model="qwen3_235b_a22b",
        gpu="H100",
        gpus=128,
        tp=2,
        cp=2,
        ep=16,
        pp=8,
        stage_layers=12,
        sequence_parallel=True,
        recompute="full",
        engine_gpus=16,
        samples=512,
        prompt_tokens=_prompt(58.9, 395, 128, 512, 5698),
        response_tokens=5698,
        max_sequence=8192,
        micro_tokens=8192,
        logprob_tokens=8192,
        optimizer_steps=1,
        published={"step": 395},
    ),
    Anchor(
        key="nemo-v0.6 qwen3-235b 256xH100",
        source=NEMO_V06,
        framework="nemo-rl",
        model="qwen3_235b_a22b",
        gpu="H100",
        gpus=256,
        tp=2,
        cp=2,
        ep=16,
        pp=8,
        stage_layers=12,
        sequence_parallel=True,
        recompute="full",
        engine_gpus=16,
        samples=512,
        prompt_tokens=_prompt(37.4, 312, 256, 512, 5713),
        response_tokens=5713,
        max_sequence=8192,
        micro_tokens=8192,
        logprob_tokens=8192,
        optimizer_steps=1,
        published={"step": 312},
    ),
    Anchor(
        key="nemo-v0.6 deepseek-v3 256xH100",
        source=NEMO_V06,
        framework="nemo-rl",
        model="deepseek_v3",
        gpu="H100",
        gpus=256,
        ep=16,
        pp=16,
        stage_layers=4,
        recompute="full",
        engine_gpus=32,
        samples=512,
        prompt_tokens=_prompt(12.1, 134, 256, 512, 701),
        response_tokens=701,
        max_sequence=1536,
        micro_tokens=1536,
        logprob_tokens=1536,
        optimizer_steps=1,
        published={"step": 134},
    ),
    Anchor(
        key="nemo-v0.6 deepseek-v3 512xH100",
        source=NEMO_V06,
        framework="nemo-rl",
        model="deepseek_v3",
        gpu="H100",
        gpus=512,
        ep=16,
        pp=16,
        stage_layers=4,
        recompute="full",
        engine_gpus=32,
        samples=512,
        prompt_tokens=_prompt(7.24, 111, 512, 512, 697),
        response_tokens=697,
        max_sequence=1536,
        micro_tokens=1536,
        logprob_tokens=1536,
        optimizer_steps=1,
        published={"step": 111},
    ),
    Anchor(
        key="nemo-v0.6 deepseek-v3 128xGB200",
        source=NEMO_V06,
        framework="nemo-rl",
        model="deepseek_v3",
        gpu="GB200",
        gpus=128,
        ep=16,
        pp=8,
        stage_layers=8,
        recompute="full",
        engine_gpus=32,
        utilization=0.3,
        samples=512,
        prompt_tokens=_prompt(30.2, 108, 128, 512, 711),
        response_tokens=711,
        max_sequence=1536,
        micro_tokens=1536,
        logprob_tokens=1536,
        optimizer_steps=1,
        published={"step": 108},
    ),
    Anchor(
        key="nemo-v0.6 deepseek-v3 256xGB200",
        source=NEMO_V06,
        framework="nemo-rl",
        model="deepseek_v3",
        gpu="GB200",
        gpus=256,
        ep=16,
        pp=8,
        stage_layers=8,
        recompute="full",
        engine_gpus=32,
        utilization=0.3,
        samples=512,
        prompt_tokens=_prompt(16.4, 98.7, 256, 512, 700),
        response_tokens=700,
        max_sequence=1536,
        micro_tokens=1536,
        logprob_tokens=1536,
        optimizer_steps=1,
        published={"step": 98.7},
    ),
    Anchor(
        key="nemo-v0.6 qwen3-235b 64xGB200",
        source=NEMO_V06,
        framework="nemo-rl",
        model="qwen3_235b_a22b",
        gpu="GB200",
        gpus=64,
        tp=2,
        cp=2,
        ep=16,
        pp=4,
        stage_layers=24,
        sequence_parallel=True,
        recompute="full",
        engine_gpus=8,
        utilization=0.4,
        samples=512,
        prompt_tokens=_prompt(163, 286, 64, 512, 5709),
        response_tokens=5709,
        max_sequence=8192,
        micro_tokens=8192,
        logprob_tokens=8192,
        optimizer_steps=1,
        published={"step": 286},
    ),
    Anchor(
        key="nemo-v0.6 qwen3-235b 128xGB200",
        source=NEMO_V06,
        framework="nemo-rl",
        model="qwen3_235b_a22b",
        gpu="GB200",
        gpus=128,
        tp=2,
        cp=2,
        ep=16,
        pp=4,
        stage_layers=24,
        sequence_parallel=True,
        recompute="full",
        engine_gpus=8,
        utilization=0.6,
        samples=512,
        prompt_tokens=_prompt(67.4, 345, 128, 512, 5693),
        response_tokens=5693,
        max_sequence=8192,
        micro_tokens=8192,
        logprob_tokens=8192,
        optimizer_steps=1,
        published={"step": 345},
    ),
    Anchor(
        key="nemo-v0.6 qwen3-30b-a3b 16xGB200",
        source=NEMO_V06,
        framework="nemo-rl",
        model="qwen3_30b_a3b",
        gpu="GB200",
        gpus=16,
        ep=16,
        engine_gpus=1,
        prompt_tokens=_prompt(1910, 221, 16, 2048, 3199),
        response_tokens=3199,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=2 * 4096,
        published={"step": 221},
    ),
)
"""NeMo-RL v0.6's on-policy rows (layouts and vLLM settings from its performance recipes)."""


def _v05(v06_key: str, *, step: float, tokens_per_s_gpu: float, generated: float, **changes: Any) -> Anchor:
    """A v0.5 row: the v0.6 row of the same recipe (the recipe files at v0.5.0 differ from v0.6's
    only where `changes` says), with v0.5's published step, throughput and mean generated length."""
    base = next(a for a in V06_ON_POLICY if a.key == v06_key)
    return replace(
        base,
        key=v06_key.replace("nemo-v0.6", "nemo-v0.5"),
        source=NEMO_V05,
        prompt_tokens=_prompt(tokens_per_s_gpu, step, base.gpus, base.samples, generated),
        response_tokens=generated,
        published={"step": step},
        **changes,
    )


V05_MOE: tuple[Anchor, ...] = (
    _v05("nemo-v0.6 qwen3-30b-a3b 32xH100", step=198, tokens_per_s_gpu=1066, generated=3196),
    _v05("nemo-v0.6 qwen3-235b 128xH100", step=431, tokens_per_s_gpu=54.1, generated=5700),
    _v05("nemo-v0.6 deepseek-v3 256xH100", step=134, tokens_per_s_gpu=12.7, generated=744),
    _v05(
        "nemo-v0.6 deepseek-v3 128xGB200", step=128, tokens_per_s_gpu=34.3, generated=996,
        utilization=0.6, micro_tokens=None, logprob_tokens=None, micro_samples=1, logprob_samples=1,
        assumed=(
            "v0.5.0's grpo-deepseek-v3-32n4g.yaml: no sequence packing (one sample per micro-batch), "
            "vLLM gpu_memory_utilization 0.6 (the base config's; v0.6 sets 0.3)",
        ),
    ),
    _v05(
        "nemo-v0.6 qwen3-235b 64xGB200", step=332, tokens_per_s_gpu=140, generated=5711, utilization=0.6,
        assumed=("vLLM gpu_memory_utilization 0.6 (v0.5.0's recipe sets none; v0.6 sets 0.4)",),
    ),
    _v05(
        "nemo-v0.6 qwen3-30b-a3b 16xGB200", step=232, tokens_per_s_gpu=1822, generated=3198,
        logprob_tokens=4 * 4096,  # v0.5.0's recipe keeps the base config's logprob_batch_size 4
    ),
)  # fmt: skip
"""NeMo-RL v0.5's on-policy MoE rows: the same recipes, run by the earlier release."""


V03_BLOG: tuple[Anchor, ...] = (
    Anchor(
        key="nemo-v0.3 llama3.1-8b 8xH100",
        source=NEMO_V03,
        framework="nemo-rl",
        model="llama3_1_8b",
        gpu="H100",
        gpus=8,
        engine_gpus=1,
        prompt_tokens=LLAMA_PROMPT,
        response_tokens=795,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=4 * 4096,
        published={"step": 112, "training": 28, "refit": 5, "generation": 58, "logprobs": 18},
        calibration=("training", "generation"),
        assumed=("vLLM TP1 per GPU (v0.3 grpo_math_8B_megatron.yaml)", "Megatron DP 8 as the blog states"),
    ),
    Anchor(
        key="nemo-v0.3 llama3.1-70b 64xH100",
        source=NEMO_V03,
        framework="nemo-rl",
        model="llama3_1_70b",
        gpu="H100",
        gpus=64,
        tp=4,
        pp=4,
        engine_gpus=4,
        prompt_tokens=LLAMA_PROMPT,
        response_tokens=398,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=4 * 4096,
        published={"step": 147, "training": 28, "refit": 14, "generation": 84, "logprobs": 18},
        calibration=("refit", "generation"),
        assumed=("vLLM TP4, gpu_memory_utilization 0.6 (v0.3 grpo_math_70B_megatron.yaml)",),
    ),
    Anchor(
        key="nemo-v0.3 qwen3-32b 64xH100",
        source=NEMO_V03,
        framework="nemo-rl",
        model="qwen3_32b",
        gpu="H100",
        gpus=64,
        tp=4,
        pp=2,
        engine_gpus=4,
        prompt_tokens=QWEN_PROMPT,
        response_tokens=3283,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=4 * 4096,
        published={"step": 213, "training": 68, "refit": 7, "generation": 96, "logprobs": 40},
        assumed=("vLLM TP4 (the v0.4 Qwen3-32B recipe's)",),
    ),
    Anchor(
        key="nemo-v0.3 qwen3-30b-a3b 64xH100",
        source=NEMO_V03,
        framework="nemo-rl",
        model="qwen3_30b_a3b",
        gpu="H100",
        gpus=64,
        tp=2,
        ep=8,
        sequence_parallel=True,
        engine_gpus=4,
        utilization=0.7,
        prompt_tokens=QWEN_PROMPT,
        response_tokens=3251,
        max_sequence=4096,
        micro_samples=1,
        logprob_samples=4,
        published={"step": 167, "training": 50, "refit": 12, "generation": 78, "logprobs": 23},
        calibration=("training", "refit"),
        assumed=(
            "vLLM TP4, gpu_memory_utilization 0.7, no sequence packing: one response per "
            "micro-batch (v0.3 grpo_math_qwen30ba3b_megatron.yaml)",
        ),
    ),
    Anchor(
        key="nemo-v0.3 llama3.3-70b 16k 128xH100",
        source=NEMO_V03,
        framework="nemo-rl",
        model="llama3_1_70b",
        gpu="H100",
        gpus=128,
        tp=4,
        pp=4,
        cp=4,
        engine_gpus=4,
        prompt_tokens=LLAMA_PROMPT,
        response_tokens=749,
        max_sequence=16384,
        micro_tokens=16384,
        logprob_tokens=4 * 16384,
        published={"step": 445, "training": 64, "refit": 17, "generation": 287, "logprobs": 75},
        unchecked={
            phase: "the blog names only CP4 of the trainer's layout; TP4 PP4 CP4 is assumed"
            for phase in ("training", "logprobs", "step")
        },
        assumed=("layout TP4 PP4 CP4 (the blog names only CP4) and vLLM TP4, as the 4k 70B row",),
    ),
)
"""The NeMo-RL v0.3 blog's per-phase rows (H100)."""


def _rerun(blog_key: str, *, response_tokens: float, published: dict[str, float]) -> Anchor:
    """A row of NeMo-RL #959: the blog row's config run again on another cluster (its recipe, so
    the blog's layout), with the rerun's own numbers; its refit is not checked (`RERUN_REFIT`)."""
    base = next(a for a in V03_BLOG if a.key == blog_key)
    return replace(
        base,
        key=blog_key.replace("nemo-v0.3", "nemo-v0.3 rerun"),
        source=NEMO_RERUN,
        response_tokens=response_tokens,
        published=published,
        calibration=(),
        unchecked={"refit": RERUN_REFIT},
        assumed=("the blog's layout (the rerun used its recipe)",),
    )


ANCHORS: tuple[Anchor, ...] = (
    # ------------------------------------------------------------------ NeMo-RL v0.3 blog, H100
    *V03_BLOG,
    # ------------------------------------- the v0.3 blog's configs rerun by a user (NeMo-RL #959)
    _rerun(
        "nemo-v0.3 llama3.1-8b 8xH100",
        response_tokens=811,
        published={"step": 116, "training": 27, "refit": 8, "generation": 56, "logprobs": 18},
    ),
    _rerun(
        "nemo-v0.3 llama3.1-70b 64xH100",
        response_tokens=396,
        published={"step": 178, "training": 31, "refit": 26, "generation": 87, "logprobs": 20},
    ),
    # ------------------------------------------------------------- NeMo-RL v0.6 / v0.5, on-policy
    *V06_ON_POLICY,
    Anchor(
        key="nemo-v0.5 llama3.1-8b 16xH100",
        source=NEMO_V05,
        framework="nemo-rl",
        model="llama3_1_8b",
        gpu="H100",
        gpus=16,
        pp=2,
        recompute="full",
        engine_gpus=1,
        prompt_tokens=_prompt(1581, 92.8, 16, 2048, 1019),
        response_tokens=1019,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=2 * 4096,
        published={"step": 92.8},
        assumed=("PP2 with activation checkpointing (the 2n8g recipe; the table's layout cell is garbled)",),
    ),
    Anchor(
        key="nemo-v0.5 qwen3-32b 32xH100",
        source=NEMO_V05,
        framework="nemo-rl",
        model="qwen3_32b",
        gpu="H100",
        gpus=32,
        tp=4,
        pp=4,
        sequence_parallel=True,
        engine_gpus=4,
        prompt_tokens=_prompt(571, 376, 32, 2048, 3251),
        response_tokens=3251,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=4 * 4096,
        published={"step": 376},
    ),
    Anchor(
        key="nemo-v0.5 llama3.1-8b 8xGB200",
        source=NEMO_V05,
        framework="nemo-rl",
        model="llama3_1_8b",
        gpu="GB200",
        gpus=8,
        recompute="full",
        engine_gpus=1,
        prompt_tokens=_prompt(3359, 91.0, 8, 2048, 1066),
        response_tokens=1066,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=2 * 4096,
        published={"step": 91.0},
    ),
    Anchor(
        key="nemo-v0.5 qwen3-32b 16xGB200",
        source=NEMO_V05,
        framework="nemo-rl",
        model="qwen3_32b",
        gpu="GB200",
        gpus=16,
        tp=2,
        sequence_parallel=True,
        engine_gpus=1,
        prompt_tokens=_prompt(1127, 381, 16, 2048, 3253),
        response_tokens=3253,
        max_sequence=4096,
        micro_tokens=4096,
        logprob_tokens=4 * 4096,
        published={"step": 381},
    ),
    *V05_MOE,
    # --------------------------------------------------------------------------- verl, H20
    Anchor(
        key="verl qwen3-30b-a3b 128xH20",
        source=VERL_H20,
        framework="verl",
        model="qwen3_30b_a3b",
        gpu="H20",
        gpus=128,
        tp=2,
        ep=8,
        sequence_parallel=True,
        engine_gpus=4,
        samples=512 * 16,
        prompt_tokens=150.0,
        response_tokens=2500.0,
        max_sequence=2048 + 8192,
        max_response=8192,
        micro_tokens=10240,
        logprob_tokens=10240,
        optimizer_steps=4,
        cpu_optimizer=True,
        utilization=0.7,
        max_running=256,
        published={"step": 497.89, "gen": 348.05, "old_log_prob": 28.73, "ref": 20.86, "update_actor": 86.27},
        solve_response_from="ref",
        calibration=("old_log_prob",),
        unchecked={
            "gen": "vLLM ran eager (enforce_eager=True: no CUDA graphs, a kernel launch per op), "
            "which the model does not price",
            "step": "includes `gen`",
        },
        assumed=(
            "mean response length: not published; solved from the published `ref` time (a forward "
            "pass is linear in tokens), so `ref` is this row's calibration",
            "prompt 150 tokens (DAPO-Math-17k with its instruction)",
            "ppo/infer max tokens per GPU 10,240, optimizer on the host, vLLM gpu_memory_utilization "
            "0.7 and max_num_seqs 256, as the doc's 96:32 script (grpo_30b_a3b_base_math_megatron_96_32.sh)",
        ),
    ),
)


def anchor_spec(anchor: Anchor) -> StepSpec:
    """The model's spec of a published run (its mean response solved first where unpublished)."""
    if anchor.solve_response_from is None:
        return _spec(anchor)
    target = anchor.published[anchor.solve_response_from]
    low, high = 1.0, float(anchor.max_response or anchor.max_sequence)
    for _ in range(40):
        mid = (low + high) / 2
        if (
            predicted(anchor, _spec(replace(anchor, response_tokens=mid)), anchor.solve_response_from)
            < target
        ):
            low = mid
        else:
            high = mid
    return _spec(replace(anchor, response_tokens=(low + high) / 2))


def predicted(anchor: Anchor, spec: StepSpec, phase: str) -> float:
    """The model's value of one published phase of `anchor` (`step`: the whole step)."""

    time = predict(spec)
    return time.step if phase == "step" else sum(time.phases[k] for k in anchor.phase_map[phase])


@functools.cache
def _model(name: str) -> tuple[ModelArch, ModelShape]:

    arch = read_model_arch(MODELS / name, {})
    return arch, model_shape(arch)


def _spec(anchor: Anchor) -> StepSpec:
    arch, shape = _model(anchor.model)
    gpu = gpu_spec(anchor.gpu)
    non_pp = anchor.gpus // anchor.pp
    dp = anchor.gpus // (anchor.tp * anchor.pp * anchor.cp)
    layout = ParallelLayout(
        world_size=anchor.gpus, tp=anchor.tp, pp=anchor.pp, cp=anchor.cp, ep=anchor.ep, etp=1, dp=dp,
        vpp=None, sequence_parallel=anchor.sequence_parallel,
    )  # fmt: skip
    assert non_pp % anchor.ep == 0, anchor.key
    stage = anchor.stage_layers or -(-shape.layers // anchor.pp)
    grad_bytes = 4 if anchor.framework == "verl" else 2  # NeMo-RL: grad_reduce_in_fp32 false
    params, _, optimizer = state_bytes(shape, layout, stage, grad_bytes=grad_bytes, distributed=True)
    cap = anchor.max_response or anchor.max_sequence - round(anchor.prompt_tokens)
    memory = gpu.memory_gib * 2**30
    engines = engine_spec(
        arch, shape, gpus=anchor.engine_gpus, count=anchor.gpus // anchor.engine_gpus,
        kv_room_bytes=vllm_kv_room(shape, anchor.engine_gpus, memory, anchor.utilization),
        max_running=anchor.max_running,
    )  # fmt: skip
    micro = anchor.micro_tokens or round(anchor.prompt_tokens + anchor.response_tokens)
    trainer = TrainerSpec(
        layout=layout,
        recompute=anchor.recompute,
        micro_batch_tokens=micro,
        logprob_micro_batch_tokens=anchor.logprob_tokens or micro,
        micro_batch_samples=anchor.micro_samples,
        logprob_micro_batch_samples=anchor.logprob_samples,
        optimizer_steps=anchor.optimizer_steps,
        layers_per_stage=stage,
        grad_bytes=grad_bytes,
        distributed_optimizer=True,
        # verl builds its DDP with overlap_grad_reduce off (`megatron_utils.get_model` at c711dd741,
        # and mbridge's `get_model`: Megatron-Core's default), NeMo-RL's recipes turn it on.
        overlap_grad_reduce=anchor.framework != "verl",
        # NeMo-RL offloads the optimizer before the update and the weights after it (gradients are
        # freed); verl offloads the weights (its optimizer already lives on the host).
        offload_bytes=params + (0 if anchor.cpu_optimizer else optimizer),
        params_bytes=params,
        cpu_optimizer_bytes=(params / 2 * 6 / max(layout.dp, 1)) if anchor.cpu_optimizer else 0.0,
        offload_reallocates=anchor.framework == "verl",
    )
    workload = Workload(
        samples=anchor.samples, prompt_tokens=anchor.prompt_tokens, response_tokens=anchor.response_tokens,
        max_response_tokens=cap,
    )  # fmt: skip
    if gpu.nvlink_domain <= 8:
        gpu = replace(gpu, nvlink_domain=8)
    elif anchor.gpus > gpu.nvlink_domain:
        # NeMo-RL v0.6.0's recipes give Slurm no `segment_size`: a job larger than one NVL72 rack
        # is placed without regard to racks, so a group may cross racks anywhere; the model takes
        # the node (4 GB200) as the NVLink domain (session 25: its 64-GPU rows fit in one rack).
        gpu = replace(gpu, nvlink_domain=4)
    # NeMo-RL v0.3 gathers every tensor whole on every GPU (`refit_utils.gather_params`) and packs
    # it for CUDA IPC; from v0.5 on its colocated refit exports HF weights with Megatron-Bridge
    # (`export_hf_weights`): each tensor is broadcast to every PP rank and all-gathered over EP, so
    # every GPU receives about the whole model (its checkpoint-engine guide: 36.8 s full-expert
    # against 10.9 s sharded, DSV3).
    transport = "gather" if anchor.source in (NEMO_V03, NEMO_RERUN) else "export"
    return StepSpec(
        model=shape, gpu=gpu, gpus_per_node=8, trainer=trainer, engines=engines, workload=workload,
        colocate=True, policy_logprobs=True, reference_logprobs=anchor.kl, transport=transport, offload=True,
    )  # fmt: skip


OPEN: dict[tuple[str, str], str] = {}
"""Published phases the model misses by more than 25%, each with what it lacks. Checked both
ways (`tests/test_step_time.py`): every other predicted phase is within 25%, and every phase
listed here still misses, so a model that gets one right must take it off this list."""


def rows() -> list[tuple[Anchor, str, float, float, str]]:
    """(anchor, phase, published, predicted, status) for every published phase; status is
    `calibration`, `unchecked`, `open` or `checked`."""
    out = []
    for anchor in ANCHORS:
        spec = anchor_spec(anchor)
        for phase, published in anchor.published.items():
            if phase in anchor.calibration or phase == anchor.solve_response_from:
                status = "calibration"
            elif phase in anchor.unchecked:
                status = "unchecked"
            elif (anchor.key, phase) in OPEN:
                status = "open"
            else:
                status = "checked"
            out.append((anchor, phase, published, predicted(anchor, spec, phase), status))
    return out
