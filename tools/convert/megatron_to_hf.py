"""Megatron-Core torch_dist -> HF safetensors. Same as `slimrl convert mcore-to-hf`.

python tools/convert/megatron_to_hf.py --ckpt DIR --out DIR --hf-config-dir DIR [--tp N --pp N --ep N]
"""

import sys

from slimrl.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main(["mcore-to-hf", *sys.argv[1:]]))
