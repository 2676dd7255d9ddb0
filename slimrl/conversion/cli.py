"""Command lines of the converters (also `slimrl convert hf-to-mcore|mcore-to-hf`).

Started plainly, a conversion starts one process per rank of the layout itself (under torchrun or
srun it joins the job instead); its ranks report a user error through a file so the caller prints
exactly one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from slimrl.errors import ConfigError, SlimError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.megatron_bridge.checkpoint_meta import check_same_architecture, read_model_meta
from slimrl.megatron_bridge.layout_args import LayoutArgs
from slimrl.megatron_bridge.safetensors_index import BridgeError, read_index
from slimrl.model_arch import read_hf_config
from slimrl.utils.cli_args import OneLineParser, positive_float, positive_int
from slimrl.utils.net import free_port

_ERROR_FILE = "SLIMRL_ERROR_FILE"
MAX_AUTO_WORKERS = 8


def _layout_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size")
    parser.add_argument(
        "--etp", type=positive_int, default=None, help="expert tensor-parallel size (default: tp)"
    )
    parser.add_argument(
        "--workers",
        type=_workers,
        default="auto",
        help="processes that split the layers between them (extra pipeline stages); default auto: "
        f"one per free core, at most one per layer and {MAX_AUTO_WORKERS}",
    )


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be `auto` or a whole number >= 1, got {text!r}")
    return int(text)


def resolve_workers(args: argparse.Namespace, inside: bool) -> int:
    """`--workers auto` as a number, the same on every rank. Joining a launched job, the job's size
    decides; starting plainly, one worker per free core for the layout's ranks, at most one per
    layer of each pipeline stage and `MAX_AUTO_WORKERS` (each pays ~0.5 GB of libraries)."""

    if args.workers != "auto":
        return args.workers
    ranks = LayoutArgs(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp).world_size
    if inside:
        world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
        return max(1, world // ranks)
    config_dir = args.hf_dir if args.direction == "hf-to-mcore" else args.hf_config_dir
    try:
        layers = int(json.loads((Path(config_dir) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1  # the conversion itself reports what is wrong with the config
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores // ranks, layers // args.pp, MAX_AUTO_WORKERS))


_FLAG_OF = {"parallel.tp": "--tp", "parallel.pp": "--pp", "parallel.ep": "--ep", "parallel.etp": "--etp"}


def flag_names(message: str) -> str:
    """A layout error in this command's terms: the trainer's checks name config keys
    (`parallel.tp=3`), the user gave flags (`--tp 3`)."""
    for key, flag in _FLAG_OF.items():
        message = re.sub(rf"\b{re.escape(key)}=(\S+)", rf"{flag} \1", message)
        message = message.replace(key, flag)
    return message


def _layout(args: argparse.Namespace):

    return LayoutArgs(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, workers=args.workers)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="slimrl convert")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron-Core torch_dist")
    to_mcore.add_argument("--hf-dir", required=True)
    to_mcore.add_argument("--out", required=True)
    _layout_flags(to_mcore)
    to_mcore.add_argument("--verify", action="store_true", help="compare HF and Megatron logits")
    to_mcore.add_argument(
        "--tolerance", type=positive_float, default=None, help="max |logit diff| for --verify"
    )
    to_mcore.add_argument("--force", action="store_true", help="replace an existing --out")
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron-Core torch_dist -> HF safetensors")
    to_hf.add_argument("--ckpt", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--hf-config-dir", required=True, help="HF dir with config.json and tokenizer")
    _layout_flags(to_hf)
    to_hf.add_argument("--max-shard-gb", type=positive_float, default=2.0)
    to_hf.add_argument("--force", action="store_true", help="replace an existing --out")
    return parser


def check_paths(args: argparse.Namespace) -> None:
    """`--out` apart from every input: `--force` replaces `--out` whole, so an input inside it (or
    it inside an input) would be deleted or half-overwritten by the conversion itself."""
    inputs = {"--hf-dir": args.hf_dir} if args.direction == "hf-to-mcore" else {
        "--ckpt": args.ckpt, "--hf-config-dir": args.hf_config_dir,
    }  # fmt: skip
    out = Path(args.out).resolve()
    for flag, value in inputs.items():
        source = Path(value).resolve()
        if out == source or source in out.parents or out in source.parents:
            raise ConfigError(
                f"--out {args.out}: overlaps {flag} {value}; write the conversion to a directory "
                f"outside its inputs"
            )


def check_inputs(args: argparse.Namespace) -> None:
    """What the launcher can refuse from `config.json`, the safetensors headers and the file system
    alone, before any rank starts (each rank would import torch and Megatron-Core first, ~5 s):
    an existing `--out`, an unsupported or incomplete config, a missing or truncated shard, a
    torch_dist checkpoint that is not ours, incomplete, or of another architecture. The ranks
    check again; what needs the tensors (shapes against the config) is theirs alone."""

    if Path(args.out).exists() and not args.force:
        raise BridgeError(f"{args.out}: output exists; pass --force to replace it")
    if args.direction == "hf-to-mcore":
        read_model_arch(args.hf_dir)
        read_index(Path(args.hf_dir))
    else:
        read_model_arch(args.hf_config_dir)
        saved = read_model_meta(Path(args.ckpt))["hf_config"]
        config = Path(args.hf_config_dir)
        check_same_architecture(saved, read_hf_config(config), config / "config.json")


def _run_rank(args: argparse.Namespace) -> None:
    from slimrl.conversion.convert import hf_to_megatron, megatron_to_hf

    layout = _layout(args)
    if args.direction == "hf-to-mcore":
        hf_to_megatron(Path(args.hf_dir), Path(args.out), layout, args.verify, args.tolerance, args.force)
    else:
        max_bytes = int(args.max_shard_gb * 1024**3)
        megatron_to_hf(
            Path(args.ckpt), Path(args.out), Path(args.hf_config_dir), layout, args.force, max_bytes
        )


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """One process per rank on this host, with the environment torchrun would give them (torchrun
    itself costs ~2.5 s of start-up per conversion). The first rank to fail stops the others."""

    world = _layout(args).world_size
    with tempfile.TemporaryDirectory() as tmp:
        error_file = Path(tmp) / "error"
        env = {
            **os.environ,
            _ERROR_FILE: str(error_file),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
        cmd = [sys.executable, "-m", "slimrl.conversion.cli", *argv]
        logs = [Path(tmp) / f"rank{rank}.stderr" for rank in range(world)]
        procs = []
        try:
            for rank, log in enumerate(logs):
                with log.open("w") as stderr:
                    rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                    procs.append(subprocess.Popen(cmd, env=rank_env, stderr=stderr))
            failed = _wait_all(procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failed is None:
            return 0
        if error_file.exists():
            code, _, message = error_file.read_text().partition(" ")
            print(f"slimrl: error: {flag_names(message)}", file=sys.stderr)
            return int(code)
        sys.stderr.write(logs[failed].read_text()[-4000:])
        return procs[failed].returncode


def _wait_all(procs: list[subprocess.Popen]) -> int | None:
    """Wait for every process; on the first failure stop the rest. Returns the failed rank."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is not None:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                proc.wait()
            return failed
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    # Import-time notices from dependencies (no apex, deprecated defaults) are not the user's concern.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    inside = "WORLD_SIZE" in os.environ or ("SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ)
    try:
        check_paths(args)
        if not inside:
            check_inputs(args)
    except SlimError as exc:
        print(f"slimrl: error: {flag_names(str(exc))}", file=sys.stderr)
        return exc.exit_code
    args.workers = resolve_workers(args, inside)
    if not inside:
        if _layout(args).world_size > 1:
            return _launch(args, [*argv, "--workers", str(args.workers)])  # the last one counts
        with _one_rank_env():
            return _run_and_report(args)
    return _run_and_report(args)


@contextlib.contextmanager
def _one_rank_env() -> Iterator[None]:
    """A plain single-process conversion is a world of one; the variables are taken away again after,
    so a caller in the same process (a test, a notebook) does not look like a launched rank to the
    next conversion it starts."""

    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_and_report(args: argparse.Namespace) -> int:
    try:
        _run_rank(args)
    except SlimError as exc:
        error_file = os.environ.get(_ERROR_FILE)
        if error_file:
            try:  # the first rank to fail reports; the others' messages are the same or consequences
                with open(error_file, "x") as handle:
                    handle.write(f"{exc.exit_code} {exc}")
            except FileExistsError:
                pass
        elif int(os.environ.get("RANK", 0)) == 0:
            print(f"slimrl: error: {flag_names(str(exc))}", file=sys.stderr)
        return exc.exit_code
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
