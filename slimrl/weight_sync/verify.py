"""Verified weight updates, with SGLang's own weight checker (`/weights_checker`) as the tool.

Two checks, both read by the driver from every engine after a push:

* **exactness** (a run's first update, when the engines start from the same HF checkpoint the
  trainer pushes): right after start each engine `snapshot`s what it loaded and `reset_tensors`
  to random values; after the push, `compare` must find every tensor of every TP rank written and
  equal (within FP8's block error on an FP8 engine). A transport that skips a tensor, writes a
  wrong shard or corrupts a bucket is named here, tensor by tensor, by SGLang's own comparison.
* **every update**: each engine reports the pushed `weight_version`; the per-tensor checksums of
  engines serving the same shards agree; and the tensors whose checksum did not change since the
  previous update are counted (an update that changed none of them transferred nothing).

Pure parsing and comparison here; `EngineChecks` makes the HTTP calls (bounded, with the run's
admin key). SGLang's reply: `{"success", "message", "ranks": [{"checksums": {name: hex},
"per_gpu_checksum", "parallelism_info"}], "per_engine_checksum"}`; a failed `compare` is HTTP 400
with `check tensor equality failed:` and one `name=... max_abs_err=...` entry per tensor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from slimrl.errors import SlimError
from slimrl.weight_sync.engines import EngineCalls, Reply

RankChecksums = dict[int, dict[str, str]]
"""TP rank -> {tensor name: checksum} of one engine."""

_ENTRY = re.compile(r"name=(?P<name>\S+) max_abs_err=(?P<max>\S+) mean_abs_err=(?P<mean>\S+)")


class UpdateMismatch(SlimError):
    """An engine does not hold the weights the trainer pushed."""


def rank_checksums(body: dict[str, Any]) -> RankChecksums:
    """Per TP rank checksums from a `checksum` reply (SGLang lists one entry per rank and role)."""
    ranks: RankChecksums = {}
    for rank in body.get("ranks") or []:
        info = rank["parallelism_info"]
        info = info[0] if isinstance(info, list) else info
        ranks.setdefault(int(info["tp_rank"]), {}).update(rank["checksums"])
    return ranks


def disagreements(engines: dict[str, RankChecksums]) -> list[str]:
    """Engines that serve the same shards (same TP size) must hold equal tensors: one line per
    engine that differs from the first of its size, naming the first differing tensor."""
    lines: list[str] = []
    first_of_size: dict[int, tuple[str, RankChecksums]] = {}
    for url, ranks in engines.items():
        ref_url, ref = first_of_size.setdefault(len(ranks), (url, ranks))
        if ref_url == url:
            continue
        for tp_rank, checksums in sorted(ranks.items()):
            expected = ref.get(tp_rank, {})
            differing = sorted(
                n for n in checksums.keys() | expected.keys() if checksums.get(n) != expected.get(n)
            )
            if differing:
                name = differing[0]
                lines.append(
                    f"engine {url} TP rank {tp_rank}: {name} has checksum {checksums.get(name)}, engine "
                    f"{ref_url} has {expected.get(name)} ({len(differing)} tensor(s) differ)"
                )
                break
    return lines


def unchanged(before: RankChecksums, after: RankChecksums) -> list[str]:
    """Tensors (`rank<r>/<name>`) whose checksum an update left as it was."""
    return sorted(
        f"rank{r}/{name}"
        for r, checksums in after.items()
        for name, value in checksums.items()
        if before.get(r, {}).get(name) == value
    )


def compare_failure(message: str, differs: str = "differs from the snapshot") -> str:
    """SGLang's `compare` message in one line: the first tensor, its error, and how many differ."""
    entries = list(_ENTRY.finditer(message))
    if not entries:
        return " ".join(message.split())[:300] or "compare failed without a message"
    first = entries[0]
    more = f" and {len(entries) - 1} more tensor(s)" if len(entries) > 1 else ""
    return f"{first['name']} {differs} (max abs error {first['max']}, mean {first['mean']}){more}"


def grouped(lines: list[tuple[str, str]]) -> str:
    """(engine url, problem) pairs in one line, engines with the same problem named together."""
    by_text: dict[str, list[str]] = {}
    for url, text in lines:
        by_text.setdefault(text, []).append(url)
    return "; ".join(f"engine{'s' if len(u) > 1 else ''} {', '.join(u)}: {t}" for t, u in by_text.items())


@dataclass(frozen=True, slots=True)
class EngineChecks:
    """`/weights_checker` and `/get_model_info` on every engine, in parallel, bounded."""

    calls: EngineCalls

    def each(
        self, urls: Sequence[str], endpoint: str, body: dict[str, Any] | None = None, *, get: bool = False
    ) -> list[Reply]:
        with ThreadPoolExecutor(max(1, min(len(urls), 32))) as pool:
            return list(pool.map(lambda u: self.calls.call(u, endpoint, body, get=get), urls))

    def action(self, urls: Sequence[str], action: str, **options: Any) -> list[Reply]:
        """A weight-checker action on every engine; a refusal other than `compare`'s is an error."""
        replies = self.each(urls, "weights_checker", {"action": action, **options})
        for reply in replies:
            if not reply.ok and action != "compare":
                raise SlimError(
                    f"update check: /weights_checker {action} refused by {reply.url}: {reply.message[:300]}"
                )
        return replies

    def versions(self, urls: Sequence[str]) -> dict[str, str | None]:
        replies = self.each(urls, "get_model_info", get=True)
        return {r.url: r.body.get("weight_version") if isinstance(r.body, dict) else None for r in replies}

    def checksums(self, urls: Sequence[str]) -> dict[str, RankChecksums]:
        return {r.url: rank_checksums(r.body) for r in self.action(urls, "checksum")}
