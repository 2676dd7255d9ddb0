"""The RL loop: rollout -> rewards/advantages -> train -> save -> weight sync -> eval.

Synchronous by default. With `algorithm.async_staleness = N >= 1` (separate devices for rollout),
the next N rollouts are generated while the trainer works on the current one, and each weight sync
pauses the generation in flight, swaps the weights and lets it continue (off-policy by at most N
updates; the importance-sampling corrections of the trainer handle the mismatch).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slimrl import estimators
from slimrl.checkpoint_dir import checkpoint_root, latest_checkpoint, read_driver_state
from slimrl.config.schema import SlimConfig
from slimrl.orchestration.colocation import MemoryHandoff
from slimrl.orchestration.fp8_start import serving_checkpoint  # the FP8 start copy, written in parallel
from slimrl.orchestration.metrics import MetricsWriter, log_due
from slimrl.orchestration.placement import ROLLOUT_SHARE_COLOCATED, DeviceSlots
from slimrl.orchestration.ray_fleet import EngineLost, RayFleet
from slimrl.orchestration.sample_log import SampleLog
from slimrl.orchestration.train_data import split_for_dp
from slimrl.orchestration.trainer_group import TrainerGroup
from slimrl.orchestration.update_check import UpdateCheck
from slimrl.rollout.client import FleetDown
from slimrl.rollout.rewards import scalar_reward
from slimrl.sample import Sample, Status
from slimrl.sampled import check_sampled
from slimrl.trainer.algorithms import overlong_reward
from slimrl.trainer.algorithms import sample_advantages as estimator
from slimrl.trainer.batch import PerToken
from slimrl.trainer.rank_api import ProbeScore
from slimrl.utils.gc_tuning import freeze_startup_heap
from slimrl.utils.hang import Hung, with_stacks
from slimrl.weight_sync.verify import UpdateMismatch

if TYPE_CHECKING:
    from slimrl.rollout.rollout import RolloutResult

logger = logging.getLogger("slimrl")


def _unless_fleet_down(rollout: Any) -> Any:
    """A rollout's result, or None when it stopped because every engine was down."""
    import ray
    from ray.exceptions import RayTaskError

    try:
        return ray.get(rollout)
    except RayTaskError as exc:
        if isinstance(exc.cause, FleetDown):
            return None
        raise


def sample_advantages(config: SlimConfig, groups: list[list[Sample]]) -> list[float]:
    """Per-sample scalar advantages from group rewards (REINFORCE++/PPO get the raw reward), with
    DAPO's overlong penalty added to the rewards first when `algorithm.overlong_buffer_len` is set."""

    algo = config.algorithm
    rewards = torch.tensor([[scalar_reward(s.reward) for s in g] for g in groups], dtype=torch.float64)
    if algo.overlong_buffer_len is not None:
        lengths = torch.tensor([[s.response_length for s in g] for g in groups])
        max_len = config.rollout.sampling.max_new_tokens
        rewards += overlong_reward(lengths, max_len, algo.overlong_buffer_len, algo.overlong_penalty_factor)
    advantages = estimator(algo.advantage_estimator, rewards, algo.normalize_std, std=algo.grpo_std)
    return advantages.reshape(-1).tolist()


AFTER_GENERATION = "the reward, filter or buffer hooks after generation"


def train_batches(config: SlimConfig, groups: list[list[Sample]], dp: int):
    samples = [s for g in groups for s in g]
    for sample in samples:  # what the engines sampled is what gets trained on
        check_sampled(sample, AFTER_GENERATION)
    if config.algorithm.overlong_filtering:  # DAPO: truncated responses are not trained on
        for sample in samples:
            if sample.status == Status.TRUNCATED:
                sample.remove_sample = True
    per_sample = sample_advantages(config, groups)
    broadcast = [[a] * s.response_length for a, s in zip(per_sample, samples, strict=True)]
    rollout_logp = [list(s.rollout_log_probs or [0.0] * s.response_length) for s in samples]
    # final advantages, or for a token-level estimator the score the trainer starts from
    if estimators.traits(config.algorithm.advantage_estimator).token_level:
        per_token = PerToken(rollout_logp=rollout_logp, scores=broadcast)
    else:
        per_token = PerToken(rollout_logp=rollout_logp, advantages=broadcast)
    return split_for_dp(samples, dp, per_token, routing=config.algorithm.routing_replay)


def oldest_weight_version(groups: list[list[Sample]]) -> int:
    """The oldest policy version (updates applied) any token of the rollout was sampled with;
    the engines' initial HF weights count as version 0."""
    versions = [int(v) if v.isdigit() else 0 for g in groups for s in g for v in s.weight_versions]
    return min(versions, default=0)


class RLRun:
    def __init__(
        self,
        config: SlimConfig,
        run_dir: Path,
        trainers: TrainerGroup,
        fleet: RayFleet,
        handoff: MemoryHandoff,
        check: UpdateCheck,
    ) -> None:
        self.config, self.run_dir, self.trainers, self.fleet = config, run_dir, trainers, fleet
        self.handoff, self.check = handoff, check
        self.fingerprints: list[tuple[float, float]] | None = None
        """Each trainer rank's weights fingerprint at the last push."""
        self.weights_moved = False
        self.update_retries = 0
        """Updates pushed a second time because their check failed, the start push included."""
        self.transport = config.rollout.weight_sync  # finalized: the transport itself, never auto
        self.ckpt_root = checkpoint_root(config, run_dir)

    # ------------------------------------------------------------------ pieces
    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights as `version` and check every engine holds them (one more push
        if not)."""
        start = time.perf_counter()
        metrics = self._push_verified(version)
        return {**metrics, "perf/weight_sync_seconds": time.perf_counter() - start}

    def _push(self, version: int, probe: bool = False) -> ProbeScore | None:
        """One push, generation paused and the memory handoff around it; with `probe`, the
        trainer's probe logprobs of the weights it pushes (while its parameters are on the
        devices). Generation goes on afterwards: the update check's probe generates. Records
        whether any trainer weight moved since the previous push (`weights_moved`)."""
        # Retract, not in place: requests in flight (async runs) give back their KV cache and are
        # prefilled again with the new weights, so the prefix cache can be flushed after the update.
        self.fleet.control("pause_generation", {"mode": "retract"})
        self.handoff.before_push()
        expected = self.trainers.probe_logprobs(self.check.probe) if probe else None
        sync_dir = str(self.run_dir / "weight_sync" / f"v{version}") if self.transport == "disk" else None
        trace_dir = self.run_dir / "weight_sync_trace"
        timeout = self.config.rollout.weight_sync_timeout_s
        fingerprints = self.trainers.push_weights(
            self.fleet.urls, self.transport, version, sync_dir, trace_dir, timeout
        )
        self.weights_moved = self.fingerprints is not None and fingerprints != self.fingerprints
        self.fingerprints = fingerprints
        self.handoff.after_push()
        self.fleet.control("continue_generation")
        return expected

    def _push_verified(self, version: int) -> dict[str, float]:
        urls = self.fleet.urls
        expected = self._push(version, probe=self.check.enabled)
        moved = self.weights_moved  # an update whose weights did not move changes no engine tensor
        try:
            return self.check.verify(urls, version, moved, expected)
        except UpdateMismatch as exc:
            first = str(exc)
        self.check.before_retry(urls)
        self.handoff.for_retry()
        self._push(version)
        named = self.check.after_retry(urls)
        logger.warning(
            "weight update %d failed its check (%s); pushed it once more: %s", version, first, named
        )
        try:
            checked = self.check.verify(urls, version, moved, expected)
            self.update_retries += 1
            return checked
        except UpdateMismatch as exc:
            raise UpdateMismatch(
                f"weight update {version} failed its check twice (rollout.verify_updates): {exc}; "
                f"{named}; {self._resume_hint()}"
            ) from None

    def save(self, step: int, row: dict[str, float]) -> None:
        """A checkpoint after `step`, its driver state holding the step's metrics row so far: a run
        stopped between the save and the row's write (a signal, a hung sync) gets the row back on
        resume, so metrics.jsonl has every step."""
        import ray

        state = {"step": step, "data": ray.get(self.fleet.manager.state_dict.remote()), "row": row}
        self.trainers.save_checkpoint(self.ckpt_root, step, state, self.config.checkpoint.keep_last)

    def resume(self) -> tuple[int, dict[str, float] | None]:
        """The step to start from, and (resumed) the metrics row of the checkpoint's step as it
        stood at the save (`save`)."""
        import ray

        latest = latest_checkpoint(self.ckpt_root) if self.config.checkpoint.resume else None
        if latest is None:
            # The engines loaded the HF checkpoint. Push when the policy starts elsewhere, or when
            # they released their memory for the trainer's start-up: released weights are gone.
            # And when the update check reset them to verify the first push.
            fresh = self.config.model.load or not self.config.model.init_from_hf
            if fresh or self.handoff.release_engines or self.check.armed:
                self.sync_weights(0)
            return 0, None
        self.trainers.load_checkpoint(latest)
        state = read_driver_state(latest)
        ray.get(self.fleet.manager.load_state_dict.remote(state["data"]))
        self.sync_weights(state["step"])  # engines started from the HF weights
        logger.info("resumed from %s (step %d)", latest, state["step"])
        return int(state["step"]), state.get("row")

    def _collect(self, step: int, pending: deque) -> RolloutResult:
        """The rollout of `step` (the first of `pending`). One that stopped because every engine
        was down is run again once the fleet is healed and has the current weights, once; an
        engine lost with its node stops the run instead (EngineLost)."""
        import ray

        rollout = _unless_fleet_down(pending[0])
        if rollout is not None:
            return rollout
        self.fleet.health()  # EngineLost when an engine's actor went with its node
        logger.warning("every engine is down: restarting them; rollout %d runs again", step)
        redo = [i for i, ref in enumerate(pending) if _unless_fleet_down(ref) is None]  # and behind it
        # First: the memory handoff talks to the engines. They were to hold everything for this
        # rollout, and the restarted ones do.
        self.handoff.restarted(self.fleet.heal(), release=False)
        self.handoff.to_trainer()
        self.sync_weights(step)
        self.handoff.to_engines()
        for i in redo:
            pending[i] = self.fleet.manager.generate.remote(step + i)
        return ray.get(pending[0])

    def heal(self) -> list[int]:
        """Restart engines that died since the last check. Colocated, the trainer's state leaves the
        devices first (a starting engine loads its weights and KV cache at once), and a restarted
        engine then releases its memory like the rest of the fleet, for the sync that follows."""
        restarted = self.fleet.heal(before_restart=self.handoff.make_room)
        self.handoff.restarted(restarted, release=True)
        return restarted

    def _resume_hint(self) -> str:
        latest = latest_checkpoint(self.ckpt_root)
        if latest is None:
            return "no checkpoint yet, a resubmission starts over"
        return f"resubmit to resume from {latest}"

    def should_save(self, step: int) -> bool:
        interval = self.config.checkpoint.save_interval
        return step == self.config.train.num_steps or (interval is not None and step % interval == 0)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        import ray

        config = self.config
        steps = config.train.num_steps
        start_step, resumed_row = self.resume()
        writer = MetricsWriter(self.run_dir, tensorboard=config.logging.tensorboard, start_step=start_step)
        if start_step and writer.last_step < start_step and resumed_row is not None:
            writer.write(start_step, resumed_row)  # the checkpoint's step had no row yet
        samples = SampleLog(self.run_dir, start_step) if config.rollout.save_samples else None
        ahead = config.algorithm.async_staleness
        pending: deque = deque()
        try:
            for step in range(start_step, steps):
                step_start = time.perf_counter()
                self.handoff.to_engines()
                while len(pending) <= ahead and step + len(pending) < steps:
                    pending.append(self.fleet.manager.generate.remote(step + len(pending)))
                result = self._collect(step, pending)
                pending.popleft()
                rollout_seconds = time.perf_counter() - step_start
                groups, rollout = result.groups, result.metrics
                rollout["weight_version_lag"] = float(step - oldest_weight_version(groups))
                batches = train_batches(config, groups, self.trainers.dp_size)
                if samples is not None:  # written while the trainer works
                    samples.append(step, groups, unfinished=result.unfinished)
                self.handoff.to_trainer()
                train_start = time.perf_counter()
                train = self.trainers.train_rl(batches)
                train_seconds = time.perf_counter() - train_start
                if self.should_save(step + 1):  # with the step's row as it stands (no sync or eval yet)
                    row = self._metrics(rollout, train, [], step_start, rollout_seconds, train_seconds)
                    self.save(step + 1, row)
                restarted = self.heal()
                synced = self.sync_weights(step + 1)
                metrics = self._metrics(rollout, train, restarted, step_start, rollout_seconds, train_seconds)
                metrics.update(synced)
                if config.eval.interval and (step + 1) % config.eval.interval == 0:
                    metrics.update(ray.get(self.fleet.manager.evaluate.remote(step + 1)))
                metrics["perf/step_seconds"] = time.perf_counter() - step_start
                writer.write(step + 1, metrics)
                if log_due(step + 1, steps, config.logging.log_interval):
                    self._progress(step + 1, steps, metrics)
        except EngineLost as exc:
            raise EngineLost(f"{exc}; the run stopped in step {step + 1}: {self._resume_hint()}") from None
        finally:
            writer.close()
            if samples is not None:
                samples.close()

    def _metrics(
        self, rollout: dict, train: dict, restarted: list[int], start: float, rollout_s: float, train_s: float
    ) -> dict[str, float]:
        metrics = {f"rollout/{k}": v for k, v in rollout.items()}
        metrics.update({k: v for k, v in train.items() if k.startswith("train/")})
        metrics["rollout/engine_restarts"] = float(self.fleet.restarts)
        metrics["verify/retries"] = float(self.update_retries)  # cumulative, as the restarts
        elapsed = time.perf_counter() - start
        # Generation = the rollout as the manager timed it (requests out, scored samples back);
        # training = the trainer ranks' own time. Everything else is orchestration overhead.
        train_compute = train.get("perf/train_seconds", 0.0)
        compute = rollout.get("seconds", 0.0) + train_compute
        metrics.update(
            {
                "perf/rollout_seconds": rollout_s,
                "perf/train_seconds": train_s,
                "perf/train_compute_seconds": train_compute,
                "perf/generation_tokens_per_s": rollout.get("tokens_per_s", 0.0),
                "perf/overhead_ratio": max(0.0, 1.0 - compute / elapsed) if elapsed > 0 else 0.0,
            }
        )
        if restarted:
            logger.warning("restarted engines %s; they got the current weights", restarted)
        return metrics

    def _progress(self, step: int, steps: int, m: dict[str, float]) -> None:
        logger.info(
            "step %d/%d | reward %.3f | resp len %.1f | pg_loss %.4f | entropy %.3f | "
            "train/rollout |dlogp| %.2e | %.1fs (rollout %.1f, train %.1f, sync %.1f)",
            step,
            steps,
            m.get("rollout/raw_reward", 0.0),
            m.get("rollout/response_length", 0.0),
            m.get("train/pg_loss", 0.0),
            m.get("train/entropy", 0.0),
            m.get("train/train_rollout_logprob_abs_diff", 0.0),
            m.get("perf/step_seconds", 0.0),
            m.get("perf/rollout_seconds", 0.0),
            m.get("perf/train_seconds", 0.0),
            m.get("perf/weight_sync_seconds", 0.0),
        )


def run_processes(run_dir: Path) -> dict[str, int]:
    """The driver and every engine server this run started (their pid files), by name."""
    import os

    named = {"driver": os.getpid()}
    for pid_file in sorted((run_dir / "logs").glob("*.pid")):
        try:
            named[pid_file.stem] = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
    return named


def first_update_checkable(config: SlimConfig, run_dir: Path) -> bool:
    """The first push sends exactly what the engines loaded: the HF checkpoint, not resumed."""
    model = config.model
    resuming = config.checkpoint.resume and latest_checkpoint(checkpoint_root(config, run_dir)) is not None
    return config.rollout.verify_first_update and model.init_from_hf and not model.load and not resuming


def run_rl(config: SlimConfig, run_dir: Path, slots: DeviceSlots, trainers: TrainerGroup) -> None:
    """The RL job on a finalized config (`preflight/finalize.py`: device, transport and offload are
    decided there, once)."""
    colocated = config.cluster.colocate
    offload = bool(config.train.offload)  # finalized for policy runs
    total_steps = config.train.num_steps * config.train.steps_per_rollout
    share = ROLLOUT_SHARE_COLOCATED if colocated else 1.0
    fleet = RayFleet(
        config, slots, config.engine_first_slot(), run_dir, share, serving_checkpoint(config, run_dir, slots)
    )  # engines load before the trainer builds
    try:
        # Colocated engines always hand their memory over, on CPU as on GPUs: SGLang's memory
        # saver has a CPU stand-in (compat/sglang_cpu/memory_saver.py) that loses what it held.
        handoff = MemoryHandoff(fleet, trainers, config.rollout.num_engines, colocated, offload)
        check = UpdateCheck(config)
        if first_update_checkable(config, run_dir):
            check.arm(fleet.urls)  # before the release below: the engines hold the HF weights
        handoff.to_trainer()
        summaries = trainers.setup(total_steps=total_steps)
        logger.info(
            "%d training ranks (%d data-parallel), %d parameters", trainers.world_size, trainers.dp_size,
            sum(s["local_params"] for s in summaries),
        )  # fmt: skip

        freeze_startup_heap()  # the driver's Ray, torch and config objects: out of later collections
        try:
            RLRun(config, run_dir, trainers, fleet, handoff, check).run()
        except Hung as exc:
            raise with_stacks(exc, run_dir, {**run_processes(run_dir), **trainers.pid_of}) from None
    finally:
        fleet.shutdown()
