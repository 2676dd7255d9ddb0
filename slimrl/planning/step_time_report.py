"""What `slimrl plan --time` prints: one config's phases, two configs side by side, or the layouts
of a config's model and cluster that fit memory, ranked by predicted step time."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

from slimrl.config.schema import SlimConfig
from slimrl.errors import ConfigError
from slimrl.parallel_layout import ParallelLayout
from slimrl.planning.engine_plan import check_config_engines, plan_engine
from slimrl.planning.gpus import GPUS, GpuSpec
from slimrl.planning.memory_plan import check_fits, plan
from slimrl.planning.step_time import StepTime, predict
from slimrl.planning.step_time_spec import arch_and_shape, spec_from_config, state_bytes

_NO_GPU = GPUS["H100"]
"""Engine specs do not depend on the GPU; a search builds them once with any."""

PHASE_NOTES = {
    "generation": "prefill + decode of the busiest engine, to its longest response",
    "rollout_logprobs": "the engine's true-on-policy re-scoring of every response",
    "policy_logprobs": "forward-only pass for the old policy's logprobs",
    "reference_logprobs": "forward-only pass under the reference weights (swapped in from host)",
    "training": "forward + backward per micro-batch, pipeline bubble, gradient sync, optimizer",
    "weight_sync": "transport to the engines, then each engine's load",
    "offload": "trainer state to host memory before the engines generate",
    "onload": "and back before the trainer runs",
    "overlap_hidden": "what async rollout hides behind training",
}


def time_config(
    config: SlimConfig,
    gpu: GpuSpec,
    prompt_tokens: float,
    response_tokens: float,
    longest: float | None = None,
) -> StepTime:
    """The config's step time; a layout that cannot fit memory is refused with the memory plan's
    line (or the engine plan's) instead of a time."""

    device = "cpu" if config.cluster.device == "cpu" else "cuda"
    memory = plan(config, device=device)
    check_fits(memory)
    if device == "cuda" and config.rollout.engine == "sglang":
        check_config_engines(config)
    spec = spec_from_config(config, gpu, prompt_tokens, response_tokens, longest, memory=memory)
    return predict(spec)


def render(config: SlimConfig, result: StepTime, title: str = "") -> str:
    rollout = config.rollout
    head = title or (
        f"step time: {Path(config.model.hf_checkpoint).name} on {config.train_world_size()} GPUs, "
        f"{rollout.rollout_batch_size} prompts x {rollout.n_samples_per_prompt} samples"
    )
    lines = [
        head,
        "",
        f"{'phase':<20}{'seconds':>10}{'share':>7}  what",
        f"{'-' * 20}{'-' * 10}{'-' * 7}  {'-' * 40}",
    ]
    for name, seconds in result.phases.items():
        if seconds == 0:
            continue
        share = f"{100 * seconds / result.step:.0f}%" if result.step else ""
        lines.append(f"{name:<20}{seconds:>10.1f}{share:>7}  {PHASE_NOTES.get(name, '')}")
    lines += [f"{'-' * 20}{'-' * 10}", f"{'step':<20}{result.step:>10.1f}", "", "assumptions:"]
    lines += [f"  {key}: {text}" for key, text in result.assumptions.items()]
    return "\n".join(lines)


def render_compare(names: tuple[str, str], a: StepTime, b: StepTime) -> str:
    width = max(len(names[0]), len(names[1]), 12)
    lines = [f"{'phase':<20}{names[0]:>{width + 2}}{names[1]:>{width + 2}}{'B/A':>8}"]
    for phase in a.phases:
        x, y = a.phases[phase], b.phases.get(phase, 0.0)
        if x == 0 and y == 0:
            continue
        ratio = f"{y / x:.2f}" if x else "-"
        lines.append(f"{phase:<20}{x:>{width + 2}.1f}{y:>{width + 2}.1f}{ratio:>8}")
    lines.append(f"{'step':<20}{a.step:>{width + 2}.1f}{b.step:>{width + 2}.1f}{b.step / a.step:>8.2f}")
    lines += ["", "assumptions that differ:"]
    for key in a.assumptions:
        if a.assumptions[key] != b.assumptions.get(key):
            lines += [f"  A {key}: {a.assumptions[key]}", f"  B {key}: {b.assumptions.get(key, '-')}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- search
@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    cp: int
    ep: int
    engine_gpus: int
    engine_ep: int

    def overrides(self) -> str:
        return (
            f"parallel.tp={self.tp} parallel.pp={self.pp} parallel.cp={self.cp} parallel.ep={self.ep} "
            f"rollout.gpus_per_engine={self.engine_gpus}"
        )


@dataclass
class Ranked:
    candidate: Candidate
    result: StepTime
    memory_gib: float
    layout: str


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _even_layout(layers: int, stages: int) -> list[int] | None:
    """Layers per stage with the remainder on the middle stages (the first holds the embedding,
    the last the output layer); None when every stage gets the same."""
    if layers % stages == 0:
        return None
    base, extra = divmod(layers, stages)
    first = (stages - extra) // 2
    return [base + (1 if first <= i < first + extra else 0) for i in range(stages)]


def _variant(config: SlimConfig, c: Candidate, layers: int) -> SlimConfig:
    out = copy.deepcopy(config)
    p = out.parallel
    p.tp, p.pp, p.cp, p.ep, p.dp, p.vpp = c.tp, c.pp, c.cp, c.ep, None, None
    p.etp = 1 if c.ep > 1 else None
    p.pp_layout = _even_layout(layers, c.pp) if c.pp > 1 else None
    p.sequence_parallel = None
    rollout = out.rollout
    rollout.gpus_per_engine = c.engine_gpus
    rollout.sglang.ep_size = c.engine_ep
    if out.cluster.colocate:
        rollout.num_engines = out.train_world_size() // c.engine_gpus
    return out


def search(
    config: SlimConfig,
    gpu: GpuSpec,
    prompt_tokens: float,
    response_tokens: float,
    longest: float | None = None,
    top: int = 10,
    budget_s: float = 45.0,
) -> tuple[list[Ranked], dict[str, int]]:
    """Every trainer layout (tp, pp, cp, ep) and engine size of the config's model on its cluster,
    ranked by predicted step time with the trainer's state estimated from parameter counts; then the
    memory plan of each, fastest first, until `top` fit (or `budget_s` is spent). Returns the ranked
    layouts that fit and the counts of each stage."""

    started = time.monotonic()
    arch, _ = arch_and_shape(config)
    world, node = config.train_world_size(), config.cluster.gpus_per_node
    budget = config.cluster.gpu_memory_gb * 2**30
    tps = [t for t in _divisors(arch.num_attention_heads, node) if arch.mla or arch.num_query_groups % t == 0]
    pps = [p for p in (1, 2, 4, 8, 16, 32) if p <= arch.num_layers and world % p == 0]
    eps = _divisors(arch.num_experts or 1, world) if arch.is_moe else [1]
    sizes = [g for g in _divisors(node, node) if world % g == 0] if config.cluster.colocate else []
    sizes = sizes or [config.rollout.gpus_per_engine]
    per_ep = max(1, config.rollout.gpus_per_engine // max(config.rollout.sglang.ep_size, 1))
    counts = {"layouts": 0, "valid": 0, "ranked_by_time": 0, "memory_plans": 0, "fit": 0}
    engines: dict[int, object] = {}
    scored: list[tuple[float, Candidate]] = []
    for tp in tps:
        for pp in pps:
            for cp in (1, 2, 4):
                for ep in eps:
                    for size in sizes:
                        counts["layouts"] += 1
                        c = Candidate(tp, pp, cp, ep, size, max(1, size // per_ep) if arch.is_moe else 1)
                        variant = _variant(config, c, arch.num_layers)
                        try:
                            layout = ParallelLayout.resolve(variant.parallel, world, arch)
                        except ConfigError:
                            continue
                        if size not in engines:
                            engines[size] = _engine_or_none(variant, plan_engine)
                        if engines[size] is None:
                            continue
                        counts["valid"] += 1
                        spec = spec_from_config(
                            variant, gpu, prompt_tokens, response_tokens, longest, from_counts=True,
                            engines=engines[size],  # type: ignore[arg-type]
                        )  # fmt: skip
                        stage = spec.trainer.layers_per_stage
                        p, g, o = state_bytes(spec.model, layout, stage, grad_bytes=4, distributed=True)
                        if p + g + (0 if config.train.optimizer.cpu_offload else o) > budget:
                            continue  # the model state alone is over: no plan needed to refuse it
                        scored.append((predict(spec).step, c))
    counts["ranked_by_time"] = len(scored)
    scored.sort(key=lambda item: item[0])
    ranked: list[Ranked] = []
    for _, c in scored:
        if len(ranked) >= top or time.monotonic() - started > budget_s:
            break
        variant = _variant(config, c, arch.num_layers)
        memory = plan(variant)
        counts["memory_plans"] += 1
        if not memory.fits:
            continue
        counts["fit"] += 1
        spec = spec_from_config(
            variant, gpu, prompt_tokens, response_tokens, longest, memory=memory,
            engines=engines[c.engine_gpus],  # type: ignore[arg-type]
        )  # fmt: skip
        lay = memory.layout
        desc = (
            f"tp={lay.tp} pp={lay.pp} cp={lay.cp} ep={lay.ep} dp={lay.dp} | {c.engine_gpus} GPUs per engine"
            + (f" (ep {c.engine_ep})" if arch.is_moe else "")
        )
        ranked.append(Ranked(c, predict(spec), memory.total / 2**30, desc))
    ranked.sort(key=lambda r: r.result.step)  # the memory plan's exact state bytes may reorder them
    return ranked, counts


def _engine_or_none(variant: SlimConfig, plan_engine):
    """The engine spec of a variant, or None when its engine cannot be built or does not fit."""

    if variant.rollout.engine == "sglang" and variant.cluster.device != "cpu":
        try:
            if not plan_engine(variant).fits:
                return None
        except ConfigError:
            return None
    return spec_from_config(variant, _NO_GPU, 1.0, 1.0, from_counts=True).engines


def render_search(ranked: list[Ranked], counts: dict[str, int], config: SlimConfig) -> str:
    model = Path(config.model.hf_checkpoint).name
    lines = [
        f"layouts of {model} on {config.train_world_size()} GPUs: {counts['layouts']} tried, "
        f"{counts['valid']} valid, {counts['ranked_by_time']} ranked by time, the fastest "
        f"{counts['memory_plans']} planned for memory, {counts['fit']} fit",
        "",
        f"{'#':>3}  {'step s':>8}{'gen s':>8}{'train s':>9}{'sync s':>8}{'GiB':>7}  layout",
    ]
    for i, r in enumerate(ranked, 1):
        p = r.result.phases
        times = f"{r.result.step:>8.1f}{p['generation']:>8.1f}{p['training']:>9.1f}{p['weight_sync']:>8.1f}"
        lines.append(f"{i:>3}  {times}{r.memory_gib:>7.1f}  {r.layout}")
    if ranked:
        lines += ["", f"best as overrides: {ranked[0].candidate.overrides()}"]
    return "\n".join(lines)
