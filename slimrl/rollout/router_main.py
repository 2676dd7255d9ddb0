"""`python -m slimrl.rollout.router_main ARGS`: sglang-router's launcher, less its import of SGLang.

`python -m sglang_router.launch_router` imports the package's Python debug balancer (`mini_lb`),
which imports SGLang: 6.5 s of CPU at every router start wherever SGLang is installed beside the
router (GPU clusters, and this project's venv). The Rust router, its argument parser and its
checks are the package's own, called as its launcher calls them; only that import is left out.
"""

from __future__ import annotations

import argparse
import sys

from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def parse(argv: list[str]) -> RouterArgs:
    """The router's settings, as `sglang_router.launch_router.parse_router_args` reads them."""
    parser = argparse.ArgumentParser(prog="python -m slimrl.rollout.router_main")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    args._validate_router_args()
    return args


def main(argv: list[str]) -> None:
    Router.from_args(parse(argv)).start()  # serves until the process is stopped


if __name__ == "__main__":
    main(sys.argv[1:])
