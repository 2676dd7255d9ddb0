"""The running batch's KV cache: one left-padded transformers `DynamicCache` for all requests.

Every request's cached keys/values end at the same column (the right edge), so one decode forward
appends one column for everybody. Row i has `pads[i]` unused columns on the left, hidden by the 2-D
attention mask; its RoPE positions come from explicit `position_ids` (= its real token count), so
padding changes neither what a token attends to nor its position. This is the layout transformers'
own batched `generate` uses, which is why its attention/mask code handles it exactly.

* admission: new requests are prefilled together, left-padded to the longest prompt (or alone
  when they need per-token extras), then `add` left-pads whichever side is shorter and
  concatenates along the batch dimension;
* exit: `keep` drops rows and then strips the columns that are padding in every remaining row.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def _layers(cache: DynamicCache) -> list:
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise TypeError(f"unsupported cache layer {type(layer).__name__} for batched decoding")
    return list(cache.layers)


def _left_pad(t: torch.Tensor, columns: int) -> torch.Tensor:
    if columns == 0:
        return t
    shape = list(t.shape)
    shape[-2] = columns
    return torch.cat([t.new_zeros(shape), t], dim=-2)


class BatchKV:
    """KV cache + padding bookkeeping of the rows of the running batch (row order = request order)."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.pads: list[int] = []
        self.length = 0
        """Columns in the cache (the same for every layer)."""

    def __len__(self) -> int:
        return len(self.pads)

    def real_lengths(self) -> list[int]:
        """Tokens actually cached per row."""
        return [self.length - pad for pad in self.pads]

    def add(self, cache: DynamicCache, pads: list[int] | None = None) -> None:
        """Append the rows of a prefilled `cache` (left-padded by `pads`, default none) at the end."""
        pads = [0] * _layers(cache)[0].keys.shape[0] if pads is None else pads
        new_len = cache.get_seq_length()
        if self.cache is None:
            self.cache, self.pads, self.length = cache, list(pads), new_len
            self._strip()
            return
        grow = max(new_len - self.length, 0)
        their_pad = self.length + grow - new_len
        for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, grow), _left_pad(theirs.keys, their_pad)], dim=0)
            mine.values = torch.cat(
                [_left_pad(mine.values, grow), _left_pad(theirs.values, their_pad)], dim=0
            )
        self.pads = [pad + grow for pad in self.pads] + [pad + their_pad for pad in pads]
        self.length += grow
        self._strip()

    def _strip(self) -> None:
        """Drop leading columns that are padding in every row."""
        strip = min(self.pads, default=0)
        if strip == 0 or self.cache is None:
            return
        for layer in _layers(self.cache):
            layer.keys = layer.keys[..., strip:, :]
            layer.values = layer.values[..., strip:, :]
        self.pads = [pad - strip for pad in self.pads]
        self.length -= strip

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); drop columns that became padding for every row."""
        if not rows:
            self.clear()
            return
        if rows == list(range(len(self.pads))):
            return
        assert self.cache is not None
        index = torch.tensor(rows, dtype=torch.long)
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.pads = [self.pads[r] for r in rows]
        self._strip()

    def grew(self) -> None:
        """Record that a decode forward appended one column to every row."""
        self.length += 1

    def attention_mask(self) -> torch.Tensor | None:
        """[B, length + 1] for the next decode step, or None when no row is padded."""
        if not any(self.pads):
            return None
        mask = torch.ones(len(self.pads), self.length + 1, dtype=torch.long)
        for row, pad in enumerate(self.pads):
            mask[row, :pad] = 0
        return mask

    def position_ids(self) -> torch.Tensor:
        """[B, 1]: the position of each row's next token (its number of cached real tokens)."""
        return torch.tensor(self.real_lengths(), dtype=torch.long).unsqueeze(1)

    def clear(self) -> None:
        self.cache, self.pads, self.length = None, [], 0

    def num_tokens(self) -> int:
        return sum(self.real_lengths())
