"""`make demo`: build the tiny assets if missing, then run `slimrl train configs/tiny_moe_cpu.yaml`."""

import sys
from pathlib import Path

from slimrl.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run(argv: list[str]) -> None:
    print("$ slimrl " + " ".join(argv), flush=True)
    code = main(argv)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    data = ROOT / "data"
    if not (data / "tiny_qwen3_moe").exists():
        run(["make-tiny", "--arch", "qwen3_moe", "--out", str(data / "tiny_qwen3_moe")])
    if not (data / "mod_sum_train.jsonl").exists():
        run(["make-data", "--task", "mod_sum", "--out", str(data / "mod_sum_train.jsonl"), "--num", "2000"])
    run(["train", str(ROOT / "configs" / "tiny_moe_cpu.yaml"), *sys.argv[1:]])
