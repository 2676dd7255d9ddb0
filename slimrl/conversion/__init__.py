"""The checkpoint converters (`slimrl convert hf-to-mcore|mcore-to-hf`, `tools/convert/`): the
command line and its launcher (`cli.py`) and the conversion of one rank (`convert.py`). Above the
trainer, whose model building and forward the `--verify` pass runs; the bridge they drive
(`slimrl/megatron_bridge/`) sits below both."""
