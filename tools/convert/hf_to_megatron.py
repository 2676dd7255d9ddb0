"""HF safetensors -> Megatron-Core torch_dist. Same as `slimrl convert hf-to-mcore`.

python tools/convert/hf_to_megatron.py --hf-dir DIR --out DIR [--tp N --pp N --ep N --etp N] [--verify]
"""

import sys

from slimrl.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-mcore", *sys.argv[1:]]))
