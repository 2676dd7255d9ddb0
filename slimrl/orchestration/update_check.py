"""The driver's check of every weight update (`rollout.verify_updates`, `verify_first_update`).

After each push, before the engines serve again:
* the first update of a run is compared tensor by tensor with what the engines loaded at start
  (SGLang's snapshot / reset / compare, `arm` then `verify`);
* every update: each engine reports the pushed version; engines serving the same shards hold equal
  tensors (per-tensor checksums); the update changed the engines' weights; and a fixed probe
  sequence scores the same on every engine as on the trainer (within
  `rollout.verify_logprob_tolerance`, mean over the probe's tokens), which catches what every
  engine got wrong alike. MoE: only the tokens before the first position where a router of the
  trainer nearly tied (`trainer/router_margins.py`) compare: from there on the engine may rightly
  route otherwise, and a token routed to another expert scores differently without any weight
  being wrong.
On a failure the loop pushes once more: `before_retry` snapshots every engine, and `after_retry`
compares, naming the tensors the second push changed (what the first one got wrong).
`weight_sync/verify.py` has the rules; this holds the state between updates and times the checks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from slimrl.config.schema import SlimConfig
from slimrl.errors import SlimError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.trainer.rank_api import ProbeScore
from slimrl.weight_sync.engines import EngineCalls
from slimrl.weight_sync.verify import (
    EngineChecks,
    RankChecksums,
    UpdateMismatch,
    compare_failure,
    disagreements,
    grouped,
    unchanged,
)

logger = logging.getLogger("slimrl")

PROBE_TOKENS = 16
PROBE_TIMEOUT_S = 300.0
BASELINE_FACTOR, BASELINE_FLOOR = 10.0, 1e-4
"""Without `rollout.verify_logprob_tolerance`: the probe may differ by this factor over the first
checked update's difference (the engine's numerics against the trainer's), and at least this."""
"""One 16-token prefill: far longer means the engine is stuck, not slow."""


def probe_tokens(vocab_size: int) -> list[int]:
    """A fixed sequence spread over the vocabulary: the same at every update, no tokenizer needed."""
    return [(7919 * i + 13) % vocab_size for i in range(PROBE_TOKENS)]


class UpdateCheck:
    def __init__(self, config: SlimConfig) -> None:
        rollout = config.rollout
        self.enabled = rollout.verify_updates
        timeout = rollout.weight_sync_timeout_s
        keys = rollout.api_key, rollout.admin_api_key
        self.checks = EngineChecks(EngineCalls(*keys, timeout_s=timeout, who="update check"))
        self.probe_calls = EngineChecks(EngineCalls(*keys, timeout_s=PROBE_TIMEOUT_S, who="update check"))
        self.allow_quant_error = rollout.sglang.quantization == "fp8"
        self.tolerance = rollout.verify_logprob_tolerance
        self.baseline: float | None = None
        """The probe difference of the first update that passed its check."""
        arch = read_model_arch(config.model.hf_checkpoint, config.model.overrides)
        self.probe = probe_tokens(arch.vocab_size)
        self.armed = False
        """Engines hold a snapshot of their start-up weights and were reset: the next push must
        write them back exactly."""
        self.retry_snapshot = False
        self.previous: dict[str, RankChecksums] = {}

    def arm(self, urls: Sequence[str]) -> None:
        """Right after start (before any release), while the engines hold the HF weights the first
        push will send: keep a copy of each, then overwrite every tensor with random values."""
        start = time.perf_counter()
        self.checks.action(urls, "snapshot")
        self.checks.action(urls, "reset_tensors")
        self.armed = True
        seconds = time.perf_counter() - start
        logger.info("update check: %d engine(s) snapshotted and reset in %.1fs", len(urls), seconds)

    def verify(
        self, urls: Sequence[str], version: int | str, expect_change: bool, expected: ProbeScore | None
    ) -> dict[str, float]:
        """Raises UpdateMismatch naming engine and tensor (or probe) when an engine does not hold
        the update; returns the check's metrics. `expected`: the trainer's score of the probe
        under the weights it pushed (`probe`, tokens 1 on)."""
        if not self.enabled and not self.armed:
            return {}
        start = time.perf_counter()
        problems = self._compare(urls, "differs from the snapshot") if self.armed else []
        self.armed = self.armed and bool(problems)  # a passed compare consumed the snapshot
        for url, reported in self.checks.versions(urls).items():
            if reported != str(version):
                problems.append((url, f"reports weight version {reported!r}, pushed {version}"))
        sums = self.checks.checksums(urls)
        disagree = disagreements(sums)
        same = {url: unchanged(self.previous[url], sums[url]) for url in sums if url in self.previous}
        for url, names in same.items():
            if expect_change and names and len(names) == sum(len(c) for c in sums[url].values()):
                problems.append((url, f"the update to version {version} changed none of its tensors"))
        worst, probe_lines = self._probe(urls, expected.compared) if expected is not None else (None, [])
        problems += probe_lines
        if problems or disagree:
            raise UpdateMismatch("; ".join([*disagree, grouped(problems)] if problems else disagree))
        self.previous = sums
        self.baseline = worst if self.baseline is None else self.baseline
        metrics = {
            "perf/verify_seconds": time.perf_counter() - start,
            "verify/unchanged_tensors": float(max((len(n) for n in same.values()), default=0)),
        }
        if expected is not None:
            metrics["verify/probe_tokens"] = float(len(expected.compared))
        if worst is not None:
            metrics["verify/probe_logprob_abs_diff"] = worst
        return metrics

    def before_retry(self, urls: Sequence[str]) -> None:
        """Before pushing a failed update again: what the engines hold now, to name what differs."""
        if not self.armed:
            self.checks.action(urls, "snapshot")
            self.retry_snapshot = True

    def after_retry(self, urls: Sequence[str]) -> str:
        """The tensors the second push wrote differently from the first, per engine (one line)."""
        if not self.retry_snapshot:
            return "the start-up snapshot checks it again"
        self.retry_snapshot = False
        return (
            grouped(self._compare(urls, "differs between the two pushes")) or "the same weights as the first"
        )

    def _compare(self, urls: Sequence[str], differs: str) -> list[tuple[str, str]]:
        replies = self.checks.action(urls, "compare", allow_quant_error=self.allow_quant_error)
        return [(r.url, compare_failure(r.message, differs)) for r in replies if not r.ok]

    def engine_logprobs(self, urls: Sequence[str]) -> dict[str, list[float | None]]:
        """Every engine's logprobs of the probe's tokens 1 on (None where it gave none)."""
        body: dict[str, Any] = {
            "input_ids": self.probe, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0,
        }  # fmt: skip
        scored = {}
        for reply in self.probe_calls.each(urls, "generate", body):
            if not reply.ok:
                failed = f"the probe /generate failed on {reply.url}"
                raise SlimError(f"update check: {failed}: {reply.message[:300]}")
            scored[reply.url] = [t[0] for t in reply.body["meta_info"]["input_token_logprobs"]][1:]
        return scored

    def _probe(
        self, urls: Sequence[str], expected: list[float]
    ) -> tuple[float | None, list[tuple[str, str]]]:
        """The probe's mean |logprob difference| engine vs trainer over the `expected` (leading)
        tokens: the worst, and one line per engine past the limit (an unanswered token, NaN
        weights' null, counts as infinite). None: a near tie at the first token left none."""
        if not expected:
            logger.info("update check: a router nearly tied at the probe's first token: no token compared")
            return None, []
        limit, setting = self._limit()
        worst, lines = 0.0, []
        for url, logprobs in self.engine_logprobs(urls).items():
            pairs = zip(logprobs[: len(expected)], expected, strict=True)
            diffs = [abs(a - b) if a is not None else math.inf for a, b in pairs]
            mean = sum(diffs) / len(diffs)
            worst = max(worst, mean) if not math.isnan(mean) else math.inf
            if not mean <= limit:
                text = f"the probe's logprobs differ from the trainer's by {mean:.3g} on average"
                lines.append((url, f"{text}, more than {limit:.3g} ({setting})"))
        return worst, lines

    def _limit(self) -> tuple[float, str]:
        if self.tolerance is not None:
            return self.tolerance, "rollout.verify_logprob_tolerance"
        if self.baseline is None:
            return math.inf, "the first update sets the baseline"  # NaN still fails
        limit = max(BASELINE_FACTOR * self.baseline, BASELINE_FLOOR)
        return (
            limit,
            f"{BASELINE_FACTOR:g}x the first update's {self.baseline:.3g}; rollout.verify_logprob_tolerance",
        )
