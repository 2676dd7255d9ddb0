"""The one way slimrl loads a checkpoint's tokenizer: what `AutoTokenizer.from_pretrained` gives.

`AutoTokenizer`'s import pulls in torch (transformers' configuration and generation modules):
~6 CPU-s in every process that only tokenizes (the rollout manager of every run, `slimrl
rollout`, the data source), while the class it picks for a checkpoint whose `tokenizer_config.json`
names the generic tokenizers-backed class (`PreTrainedTokenizerFast`, in transformers 5 the same
class as `TokenizersBackend`; the tiny models of `slimrl make-tiny` are such) loads without torch.
That case takes the class directly; every other (a model-specific class, remote code, no
`tokenizer.json`) goes through `AutoTokenizer` as before. `tests/test_tokenizer.py` holds the two
paths equal with transformers' own `AutoTokenizer` as the referee.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
"""`tokenizer_class` values that name the generic class (transformers 5: one class, two names)."""


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _generic(path: Path) -> bool:
    """The checkpoint names the generic class and maps `AutoTokenizer` to no code of its own (in
    either of transformers' two places for it)."""
    config = _json(path / "tokenizer_config.json")
    model_map = _json(path / "config.json").get("auto_map")
    return (
        config.get("tokenizer_class") in GENERIC_CLASSES
        and "auto_map" not in config
        and not (isinstance(model_map, dict) and "AutoTokenizer" in model_map)
        and (path / "tokenizer.json").is_file()
    )


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """`AutoTokenizer.from_pretrained(path)`, without importing torch when the class is generic."""
    if _generic(Path(path)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(
            str(path), trust_remote_code=False
        )  # no code of its own
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
