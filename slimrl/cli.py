"""`slimrl`: one console script, one subcommand per job. Heavy imports happen inside handlers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from slimrl.conversion.cli import build_parser as convert_parser
from slimrl.conversion.cli import main as convert_main
from slimrl.data.toy_tasks import TASKS, make_data
from slimrl.errors import ConfigError, SlimError
from slimrl.planning import step_time_report as report
from slimrl.planning.engine_plan import check_config_engines, plan_engine
from slimrl.planning.gpus import GPUS, gpu_spec
from slimrl.planning.memory_plan import check_fits, plan
from slimrl.planning.step_time import check_workload
from slimrl.utils.cli_args import OneLineParser, non_negative_int, port, positive_float, positive_int
from slimrl.utils.gc_tuning import freeze_startup_heap
from slimrl.utils.hang import register_stack_signal
from slimrl.utils.plot import plot_metric

Handler = Callable[[argparse.Namespace], int | None]


def _train(args: argparse.Namespace) -> None:
    from slimrl.preflight import load_config

    if args.json and not args.dry_run:
        raise ConfigError("--json: prints the dry run's report; use it with --dry-run")
    config = load_config(args.config, args.overrides)
    if args.dry_run:  # no Ray, no processes: print what would start where, and how
        from slimrl.orchestration.dry_run import render, render_json

        print(json.dumps(render_json(config)) if args.json else render(config), flush=True)
        return
    from slimrl.orchestration.entry import run_training

    run_training(config)


def _rollout(args: argparse.Namespace) -> None:
    from slimrl.orchestration.rollout_only import run_rollout_only
    from slimrl.preflight import load_config

    run_rollout_only(load_config(args.config, args.overrides), args.num_rollouts)


def _plan(args: argparse.Namespace) -> None:
    """Print the per-GPU memory plans of the trainer and of one rollout engine; a layout that cannot
    fit exits 2 with one line on stderr (an engine that does not fit is refused at load). With
    --time (or --compare / --search): the step time instead, phase by phase."""
    if args.time or args.compare or args.search:
        _plan_time(args)
        return
    if args.json:
        raise ConfigError("--json: prints the step-time plan; use it with --time, --compare or --search")
    from slimrl.preflight import load_config

    config = load_config(args.config, args.overrides)
    memory = plan(config, device=args.device)
    print(memory.render(), flush=True)
    if memory.device == "cuda" and config.rollout.engine == "sglang" and config.algorithm.loss == "policy":
        engine = plan_engine(config)
        print("\n" + engine.render(), flush=True)
        check_config_engines(config)  # already at load, unless --device cuda plans a CPU config
    check_fits(memory)


def _plan_time(args: argparse.Namespace) -> None:
    """`slimrl plan CONFIG --time`: docs/step_time.md."""
    from slimrl.preflight import load_config

    prompt, response = check_workload(args.prompt_tokens, args.response_tokens)
    config = load_config(args.config, args.overrides)
    if args.gpu is None and config.cluster.device == "cpu":
        raise ConfigError(
            "--gpu: this config runs on CPU (cluster.device=cpu); give --gpu NAME to plan it on GPUs "
            "(bench/bench_step_time.py times the CPU twin from this machine's measured peaks)"
        )
    gpu = gpu_spec(args.gpu or "H100")
    if args.search:
        ranked, counts = report.search(config, gpu, prompt, response, args.longest_response)
        if args.json:
            rows = [{"layout": r.layout, "overrides": r.candidate.overrides(), "memory_gib": r.memory_gib,
                     **r.result.as_json()} for r in ranked]  # fmt: skip
            print(json.dumps({"counts": counts, "ranked": rows}), flush=True)
        else:
            print(report.render_search(ranked, counts, config), flush=True)
        return
    result = report.time_config(config, gpu, prompt, response, args.longest_response)
    if args.compare:
        other = load_config(args.compare, args.overrides)
        second = report.time_config(other, gpu, prompt, response, args.longest_response)
        if args.json:
            print(json.dumps({"a": result.as_json(), "b": second.as_json()}), flush=True)
        else:
            print(report.render_compare(("A", "B"), result, second), flush=True)
            print(f"\nA: {args.config}\nB: {args.compare}", flush=True)
        return
    print(json.dumps(result.as_json()) if args.json else report.render(config, result), flush=True)


def _plot(args: argparse.Namespace) -> None:
    from pathlib import Path

    keys = args.key or ["rollout/raw_reward"]
    name = "+".join(key.replace("/", "_") for key in keys) + ".png"
    out = Path(args.out) if args.out else Path(args.run_dir) / name
    print(f"wrote {plot_metric(Path(args.run_dir), out, keys, args.window)}")


def _make_tiny(args: argparse.Namespace) -> None:
    from slimrl.data.tiny_models import make_tiny

    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if not _ or not key:
            raise ConfigError(f"make-tiny --set {item}: expected key=value (a config.json key)")
        overrides[key] = json.loads(value) if value[:1] in "-0123456789[{tfn" else value
    out = make_tiny(args.arch, args.out, seed=args.seed, overrides=overrides, force=args.force)
    print(f"wrote {args.arch} checkpoint to {out}")


def _make_data(args: argparse.Namespace) -> None:

    out = make_data(args.task, args.out, num_samples=args.num, seed=args.seed)
    print(f"wrote {args.num} {args.task} samples to {out}")


def _serve(args: argparse.Namespace) -> None:
    from pathlib import Path

    from slimrl.rollout.embedded.engine import EngineError
    from slimrl.rollout.embedded.server import ServerArgs, run

    if not Path(args.model, "config.json").is_file():
        raise ConfigError(f"serve --model {args.model}: not a Hugging Face checkpoint (no config.json)")
    server_args = ServerArgs(
        model_path=args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
        true_on_policy=args.true_on_policy,
        weights_cpu_backup=args.enable_weights_cpu_backup,
        trust_remote_code=args.trust_remote_code,
    )

    def ready(url: str) -> None:

        freeze_startup_heap()  # the loaded model and libraries: out of every later collection
        print(f"slimrl serve: ready at {url} (model {args.model})", flush=True)

    try:
        run(server_args, on_ready=ready)
    except EngineError as exc:
        raise SlimError(f"serve: {exc}") from None
    # The server has stopped and nothing is left to flush; tearing down torch/transformers module
    # state would take seconds more, which makes a SIGTERM'd server linger.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_parser() -> argparse.ArgumentParser:

    parser = OneLineParser(prog="slimrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a policy (SFT or RL) from a YAML config")
    train.add_argument("config", help="YAML config, e.g. configs/tiny_moe_cpu.yaml")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.tp=2")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print placement, weight-sync transport and every engine's launch command and "
        "environment, then exit without starting anything (memory: `slimrl plan`)",
    )
    train.add_argument(
        "--json",
        action="store_true",
        help="with --dry-run: the device ledger as JSON (every process on its node and GPU, every "
        "group and device reference, the transports) plus each engine's launch",
    )
    train.set_defaults(handler=_train)

    rollout = sub.add_parser("rollout", help="generation only: run rollouts and write the samples")
    rollout.add_argument("config", help="YAML config")
    rollout.add_argument("overrides", nargs="*", help="key=value overrides")
    rollout.add_argument("--num-rollouts", type=positive_int, default=1)
    rollout.set_defaults(handler=_rollout)

    plan = sub.add_parser(
        "plan", help="estimate per-GPU memory of a config's layout; exit 2 when it cannot fit"
    )
    plan.add_argument("config", help="YAML config, e.g. configs/qwen3_30b_a3b_8gpu.yaml")
    plan.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.ep=8")
    plan.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="plan for this device (default: cluster.device; `auto` resolves on this machine)",
    )
    plan.add_argument(
        "--time",
        action="store_true",
        help="predict each phase of an RL step and the step (docs/step_time.md); needs --prompt-tokens "
        "and --response-tokens",
    )
    plan.add_argument(
        "--gpu",
        type=str.upper,
        choices=list(GPUS),
        default=None,
        help="GPU of the cluster for --time (default: H100)",
    )
    plan.add_argument(
        "--prompt-tokens", type=positive_float, default=None, help="mean prompt tokens per sample"
    )
    plan.add_argument(
        "--response-tokens", type=positive_float, default=None, help="mean generated tokens per sample"
    )
    plan.add_argument(
        "--longest-response",
        type=positive_float,
        default=None,
        help="longest response of a step in tokens (default: the cap, rollout.sampling.max_new_tokens)",
    )
    plan.add_argument("--json", action="store_true", help="with --time/--compare/--search: JSON on stdout")
    plan.add_argument(
        "--compare", default=None, metavar="CONFIG_B", help="--time of CONFIG and CONFIG_B side by side"
    )
    plan.add_argument(
        "--search",
        action="store_true",
        help="rank the layouts of the config's model and cluster that fit memory by predicted step time",
    )
    plan.set_defaults(handler=_plan)

    plot = sub.add_parser("plot", help="plot metrics of a run (metrics.jsonl) to a PNG")
    plot.add_argument("run_dir", help="run directory, e.g. runs/tiny_moe_grpo")
    plot.add_argument(
        "--key",
        action="append",
        help="metric to plot (repeat for several curves; default rollout/raw_reward)",
    )
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/<key>[+<key>...].png)")
    plot.add_argument("--window", type=positive_int, default=10, help="steps in the trailing mean")
    plot.set_defaults(handler=_plot)

    tiny = sub.add_parser("make-tiny", help="write a tiny random Hugging Face checkpoint")
    tiny.add_argument(
        "--arch", required=True, choices=["qwen3_moe", "qwen3", "qwen2", "llama", "deepseek_v3"]
    )
    tiny.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    tiny.add_argument("--seed", type=non_negative_int, default=0)
    tiny.add_argument("--set", action="append", default=[], help="config.json override key=value")
    tiny.add_argument("--force", action="store_true", help="replace an existing output directory")
    tiny.set_defaults(handler=_make_tiny)

    data = sub.add_parser("make-data", help="write a toy prompt data set (JSONL: prompt, label, metadata)")
    data.add_argument("--task", required=True, choices=sorted(TASKS))
    data.add_argument("--out", required=True)
    data.add_argument("--num", type=positive_int, default=1000)
    data.add_argument("--seed", type=non_negative_int, default=0)
    data.set_defaults(handler=_make_data)

    serve = sub.add_parser(
        "serve", help="serve an HF checkpoint over SGLang's HTTP API (embedded CPU engine)"
    )
    serve.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    serve.add_argument("--port", type=port, required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every call")
    serve.add_argument(
        "--admin-api-key", default=None, help="require this key (and only it) on control calls"
    )
    serve.add_argument("--max-running-requests", type=positive_int, default=64)
    serve.add_argument(
        "--seed", type=non_negative_int, default=0, help="seeds requests that carry no sampling_seed"
    )
    serve.add_argument(
        "--true-on-policy",
        action="store_true",
        help="report logprobs computed exactly as the Megatron trainer does (docs/true_on_policy.md)",
    )
    serve.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep a host copy of the weights across a memory release (SGLang's flag); without it "
        "released weights come back as NaN and must be loaded again",
    )
    serve.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run code shipped with the checkpoint (SGLang's flag; model.trust_remote_code)",
    )
    serve.set_defaults(handler=_serve)

    convert = sub.add_parser(
        "convert", help="HF <-> Megatron-Core checkpoints", parents=[convert_parser()], add_help=False
    )
    convert.set_defaults(handler=None)
    return parser


def _one_line(exc: SlimError) -> str:
    """A SlimError raised inside a Ray actor arrives wrapped (its text is the remote traceback):
    report the original message only."""
    cause = getattr(exc, "cause", None)
    return " ".join(str(cause if isinstance(cause, SlimError) else exc).split())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    register_stack_signal()  # the driver, a server: stacks on demand when a wait expires
    if argv[:1] == ["convert"]:  # the converter relaunches itself under torchrun
        return convert_main(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `plan CONFIG --time key=value`: argparse stops taking positionals after a flag
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        args.handler(args)
    except SlimError as exc:
        print(f"slimrl: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("slimrl: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
