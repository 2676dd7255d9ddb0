"""MoE routing replay (R3) in the trainer, with the Hugging Face model as referee.

The HF model's router is observed and overridden where it picks its experts (`torch.topk` inside
`Qwen3MoeTopKRouter`); everything else in its forward is its own. Under every layout, Megatron with
replay of (a) the routing the model chooses itself gives the logprobs it gives without replay, and
of (b) a different routing (each engine expert e replaced by e + 1 mod E) the HF logprobs under
that same forced routing; (c) packed micro-batches give what one sequence at a time gives; (d) a
routing of the wrong shape is one line naming the sample.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from slimrl.errors import SlimError
from slimrl.megatron_bridge.archs import read_model_arch
from slimrl.orchestration.train_data import split_for_dp
from slimrl.orchestration.update_check import probe_tokens
from slimrl.sample import Sample
from slimrl.trainer.batch import TrainBatch, collate, collate_packed
from slimrl.trainer.rank_api import ProbeScore, merged_probe
from slimrl.trainer.router_margins import ROUTER_TIE
from slimrl.trainer.routing_replay import check_routing, valid_positions
from tests.conftest import REPO, run_torchrun

WORKER = REPO / "tests" / "dist" / "replay_worker.py"


@contextlib.contextmanager
def hf_router_topk(
    forced: np.ndarray | None, seen: list[torch.Tensor], scores: list[torch.Tensor] | None = None
) -> Iterator[None]:
    """While active, the l-th `torch.topk` call of a forward (layer l's router) records its own
    choice into `seen` (and the probabilities it ranks into `scores`) and, with `forced`
    `(tokens, layers, k)`, returns those experts instead."""
    real = torch.topk

    def topk(values: torch.Tensor, k: int, dim: int = -1, **kwargs):
        own = real(values, k, dim=dim, **kwargs)
        layer = len(seen)
        seen.append(own.indices)
        if scores is not None:
            scores.append(values.detach().clone())
        if forced is None:
            return own
        rows = values.shape[0]
        index = torch.from_numpy(forced[:rows, layer].astype(np.int64))
        index = torch.cat([index, own.indices[len(index) :]])  # the last token has no routing
        return torch.return_types.topk((values.gather(1, index), index))

    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = real


def hf_score(model, tokens: list[int], response: int, forced: np.ndarray | None = None):
    """Response logprobs and the router's own routing `(len - 1, layers, k)` of one sequence."""
    seen: list[torch.Tensor] = []
    with torch.no_grad(), hf_router_topk(forced, seen):
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1))[:, 0]
    routing = torch.stack(seen, dim=1)[:-1].numpy().astype(np.uint8)
    return logprobs[-response:].tolist(), routing


def hf_forced(model, tokens, responses, routings) -> tuple[list[list[float]], float]:
    """HF logprobs under forced routings, and the fraction of (token, layer) pairs where the
    router's own choice (from the inputs the forced routing produced) differs from the forced one."""
    scored = [hf_score(model, t, r, f) for t, r, f in zip(tokens, responses, routings, strict=True)]
    differs = [
        (np.sort(chosen, axis=-1) != np.sort(forced, axis=-1)).any(axis=-1).reshape(-1)
        for (_, chosen), forced in zip(scored, routings, strict=True)
    ]
    return [logprobs for logprobs, _ in scored], float(np.concatenate(differs).mean())


def hf_probe(model, tokens: list[int]) -> tuple[list[float], dict[int, float]]:
    """The update check's probe under HF's own routing: logprobs of tokens 1 on, and per input
    position (all but the last) the smallest relative gap between the k-th and (k+1)-th expert
    probability over the layers, by the definition in `trainer/router_margins.py`."""
    seen: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []
    with torch.no_grad(), hf_router_topk(None, seen, scores):
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1))[:, 0]
    k = model.config.num_experts_per_tok
    margins: dict[int, float] = {}
    for probs in scores:
        ranked = probs.float().sort(dim=1, descending=True).values
        gap = (ranked[:, k - 1] - ranked[:, k]) / ranked[:, 0].abs()  # probabilities: max |p| = top 1
        for position, value in enumerate(gap[:-1].tolist()):  # the last token has no routing
            margins[position] = min(value, margins.get(position, value))
    return logprobs.tolist(), margins


@dataclass
class Case:
    """A batch on one tiny model, its routings, and what HF computes under each."""

    path: Path
    data_path: Path
    hf: dict[str, list[list[float]]]
    """Per routing: HF fp32 logprobs under it (`engine_bf16`: the bf16 engine's own logprobs)."""
    disagreement: dict[str, float]
    """Per routing: HF's own-choice disagreement under it."""
    probe: tuple[list[float], dict[int, float]]
    """HF's score of the update check's probe (`hf_probe`)."""


@pytest.fixture(scope="module")
def cases(tiny_model, tmp_path_factory) -> dict[int, Case]:
    """Per model depth (16 experts, top-4: bf16 flips some choices), the batch and its routings:
    `own` (fp32 HF's choice), `permuted` (e + 1 mod 16 of it), `engine` (bf16 HF's choice)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for layers in (2, 4):
        path = tiny_model("qwen3_moe", num_hidden_layers=layers, num_experts=16, num_experts_per_tok=4)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engine = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        rng = random.Random(layers)
        tokens = [
            [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randrange(10, 30))]
            for _ in range(6)
        ]
        responses = [rng.randrange(3, len(t) - 2) for t in tokens]
        own = [hf_score(model, t, r)[1] for t, r in zip(tokens, responses, strict=True)]
        engine_scored = [hf_score(engine, t, r) for t, r in zip(tokens, responses, strict=True)]
        routings = {
            "own": own,
            "permuted": [((r.astype(np.int64) + 1) % 16).astype(np.uint8) for r in own],
            "engine": [routing for _, routing in engine_scored],
        }
        hf, disagreement = {}, {}
        for name in ("permuted", "engine"):
            hf[name], disagreement[name] = hf_forced(model, tokens, responses, routings[name])
        hf["engine_bf16"] = [logprobs for logprobs, _ in engine_scored]
        probe = probe_tokens(model.config.vocab_size)
        data = {
            "tokens": tokens,
            "response_lengths": responses,
            "rollout_log_probs": hf["permuted"],
            "probe": probe,
            **routings,
        }
        data_path = tmp_path_factory.mktemp("replay") / f"data{layers}.pt"
        torch.save(data, data_path)
        out[layers] = Case(
            path=path, data_path=data_path, hf=hf, disagreement=disagreement, probe=hf_probe(model, probe)
        )
    return out


ROUTINGS = ("own", "permuted", "engine")


def run_layout(tmp_path, case: Case, nproc: int, overrides: list[str]):
    args = [
        str(case.data_path),
        f"model.hf_checkpoint={case.path}",
        f"cluster.gpus_per_node={nproc}",
        "algorithm.routing_replay=true",
        "algorithm.routing_replay_counterfactual=true",
        "algorithm.kl_loss_coef=0.1",
        "train.optimizer.lr=1e-3",
        *overrides,
    ]
    results = run_torchrun(WORKER, nproc, args, tmp_path / "run")
    last = [r for r in results if r["replay/own"]]  # logprobs live on the last pipeline stage
    keys = [f"replay/{name}" for name in ROUTINGS] + ["free"]
    merged = {key: {k: v for r in last for k, v in r[key].items()} for key in keys}
    metrics = next(r["metrics"] for r in results if "train/pg_loss" in r["metrics"])
    return merged, results, metrics


def abs_diffs(ours: dict[str, list[float]], theirs: list[list[float]]) -> list[float]:
    return [abs(a - b) for k, values in enumerate(theirs) for a, b in zip(ours[str(k)], values, strict=True)]


def max_abs_diff(ours: dict[str, list[float]], theirs: list[list[float]]) -> float:
    return max(abs_diffs(ours, theirs))


def mean_abs_diff(ours: dict[str, list[float]], theirs: list[list[float]]) -> float:
    diffs = abs_diffs(ours, theirs)
    return sum(diffs) / len(diffs)


LAYOUTS = [
    pytest.param(1, ["train.max_tokens_per_gpu=40"], 2, id="packed"),
    pytest.param(1, ["train.micro_batch_size=1"], 2, id="one_at_a_time"),
    pytest.param(2, ["parallel.tp=2", "train.max_tokens_per_gpu=40"], 2, id="tp2_sp"),
    pytest.param(2, ["parallel.ep=2", "train.max_tokens_per_gpu=40"], 2, id="ep2"),
    pytest.param(2, ["parallel.pp=2", "parallel.vpp=2", "train.max_tokens_per_gpu=40"], 4, id="pp2_vpp2"),
    # 1F1B runs several forwards before their backwards: each recompute must take its own targets
    pytest.param(
        2, ["parallel.pp=2", "parallel.recompute=full", "train.max_tokens_per_gpu=40"], 2, id="pp2_recompute"
    ),
]


@pytest.fixture(scope="module")
def packed(cases, tmp_path_factory):
    return run_layout(tmp_path_factory.mktemp("packed"), cases[2], 1, ["train.max_tokens_per_gpu=40"])


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "overrides", "layers"), LAYOUTS)
def test_replay_matches_own_routing_and_hf_under_forced_routing(
    tmp_path, cases, packed, nproc, overrides, layers
):
    case = cases[layers]
    same_as_packed = (nproc, overrides, layers) == (1, ["train.max_tokens_per_gpu=40"], 2)
    logprobs, results, metrics = packed if same_as_packed else run_layout(tmp_path, case, nproc, overrides)
    # The update check's probe (scored first, routers free): HF's logprobs, and every router's
    # decision margin per position as HF's probabilities give it, merged over the ranks
    probe = merged_probe(
        [ProbeScore(r["probe"]["logprobs"], {int(p): m for p, m in r["probe"]["margins"].items()},
                    r["probe"]["tie_at"]) for r in results]
    )  # fmt: skip
    hf_logprobs, hf_margins = case.probe
    assert probe.logprobs == pytest.approx(hf_logprobs, abs=2e-5)
    assert sorted(probe.margins) == sorted(hf_margins) == list(range(len(hf_logprobs)))
    assert [probe.margins[p] for p in sorted(hf_margins)] == pytest.approx(
        [hf_margins[p] for p in sorted(hf_margins)], abs=1e-5
    )
    assert probe.tie_at == min((p for p, m in hf_margins.items() if m < ROUTER_TIE), default=None)
    # (a) replaying the model's own choice changes nothing
    free = [logprobs["free"][str(k)] for k in range(len(logprobs["free"]))]
    assert max_abs_diff(logprobs["replay/own"], free) < 1e-6
    # (b) a forced routing gives HF's logprobs under the same routing, far from the free ones
    for name in ("permuted", "engine"):
        assert max_abs_diff(logprobs[f"replay/{name}"], case.hf[name]) < 2e-5, name
    assert max_abs_diff(logprobs["free"], case.hf["permuted"]) > 1e-3
    assert case.disagreement["permuted"] > 0.9  # layer 1 always differs, later ones mostly
    assert 0.0 < case.disagreement["engine"] < 0.2  # bf16 flips a few experts
    for rank in results:
        assert rank["disagreement/own"] == 0.0
        for name in ("permuted", "engine"):
            assert rank[f"disagreement/{name}"] == pytest.approx(case.disagreement[name], abs=1e-12), name
    # The bf16 engine against the fp32 trainer: replaying its routing brings the mismatch down. The
    # mean, not the max: where the routes agree, both sides differ by the same bf16 rounding, and on
    # some CPUs the largest such difference is larger than any a flipped route makes.
    engine = case.hf["engine_bf16"]
    # Measured: 8.7e-4 with replay vs 9.4e-4 without (7.7% less); required: half that effect.
    replayed = mean_abs_diff(logprobs["replay/engine"], engine)
    unreplayed = mean_abs_diff(logprobs["free"], engine)
    assert replayed < (1 - 0.035) * unreplayed, (replayed, unreplayed)
    # One RL step on the permuted routing: the training forward replays it (its old logprobs equal
    # HF's under it), the reference model replays it too (KL 0 while the weights are equal).
    assert metrics["train/routing_disagreement"] == pytest.approx(case.disagreement["permuted"], abs=1e-12)
    assert metrics["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert metrics["train/train_rollout_logprob_abs_diff_max"] < 2e-5
    assert metrics["train/train_rollout_prob_ratio_median"] == pytest.approx(1.0, abs=1e-5)
    # The same step's counterfactual (algorithm.routing_replay_counterfactual): the mismatch to the
    # rollout (HF under the permuted routing) had the trainer not replayed, over every loss token of
    # every DP rank: the no-replay logprobs' distance to HF's, far above the replayed one.
    diffs = np.abs(np.concatenate([np.subtract(free[k], hf) for k, hf in enumerate(case.hf["permuted"])]))
    assert diffs.max() > 1e-3
    no_replay = {k.removesuffix("_no_replay"): v for k, v in metrics.items() if k.endswith("_no_replay")}
    assert no_replay["train/train_rollout_logprob_abs_diff"] == pytest.approx(diffs.mean(), abs=1e-7)
    assert no_replay["train/train_rollout_logprob_abs_diff_max"] == pytest.approx(diffs.max(), abs=1e-7)
    median = float(np.median(np.exp(diffs)))  # torch's quantile(0.5) interpolates as numpy's median
    assert no_replay["train/train_rollout_prob_ratio_median"] == pytest.approx(median, abs=1e-7)
    if layers == 2:  # (c) and the update: the same as packed micro-batches on one rank
        reference, _, ref_metrics = packed
        for key, values in reference["replay/permuted"].items():
            assert logprobs["replay/permuted"][key] == pytest.approx(values, abs=1e-5), key
        assert metrics["train/grad_norm"] == pytest.approx(ref_metrics["train/grad_norm"], abs=1e-5)


@pytest.mark.slow
def test_ppo_policy_replays_and_critic_routes_on_its_own(tmp_path, cases):
    """The engine's routing was chosen by the policy's routers: the PPO critic (an MoE too) is built
    without replay and trains beside the replaying policy."""
    ppo = ["algorithm.advantage_estimator=ppo", "critic.lr=1e-4", "train.max_tokens_per_gpu=40"]
    _, results, metrics = run_layout(tmp_path, cases[2], 1, ppo)
    assert results[0]["critic_replaying_routers"] == 0
    assert metrics["train/routing_disagreement"] == pytest.approx(
        cases[2].disagreement["permuted"], abs=1e-12
    )
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert metrics["train/value_loss"] > 0.0


def _batch(lengths: list[int], routed: list[np.ndarray]) -> TrainBatch:
    return TrainBatch(
        tokens=[list(range(3, 3 + n)) for n in lengths],
        response_lengths=[2] * len(lengths),
        loss_masks=[[1, 1]] * len(lengths),
        routed_experts=routed,
        sample_indices=[40 + k for k in range(len(lengths))],
    )


def test_micro_batches_carry_routing_where_the_tokens_are():
    """Row i of a sequence's routing sits at its token i; other positions hold experts 0..K-1."""
    routed = [np.full((n - 1, 2, 2), 10 + k, dtype=np.uint8) for k, n in enumerate((4, 3))]
    packed = collate_packed(_batch([4, 3], routed), pad_to_multiple=4)
    assert packed.routed_experts_BSLK is not None
    assert packed.routed_experts_BSLK.shape == (1, 8, 2, 2)
    firsts = packed.routed_experts_BSLK[0, :, 0].tolist()
    assert firsts == [[10, 10]] * 3 + [[0, 1]] + [[11, 11]] * 2 + [[0, 1]] * 2
    assert valid_positions(packed)[0].tolist() == [True] * 3 + [False] + [True] * 2 + [False] * 2
    padded = collate(_batch([4, 3], routed))
    assert padded.routed_experts_BSLK is not None
    assert padded.routed_experts_BSLK[1, :, 1].tolist() == [[11, 11]] * 2 + [[0, 1]] * 2


def test_wrong_routing_shape_is_one_line_naming_the_sample(tiny_model):
    arch = read_model_arch(tiny_model("qwen3_moe"))  # 2 MoE layers, top-2 of 4 experts
    good = np.tile(np.array([0, 1], dtype=np.uint8), (4, 2, 1))
    cases = {
        "(4, 1, 2)": np.zeros((4, 1, 2), dtype=np.uint8),  # a layer short
        "(4, 2, 3)": np.zeros((4, 2, 3), dtype=np.uint8),  # top-3
        "(5, 2, 2)": np.zeros((5, 2, 2), dtype=np.uint8),  # one row per token, not per input
    }
    for shape, bad in cases.items():
        with pytest.raises(SlimError) as info:
            check_routing(_batch([5, 5], [good, bad]), arch)
        message = str(info.value)
        assert "\n" not in message and message.startswith("sample 41:") and shape in message
        assert "expected (4, 2, 2)" in message
    with pytest.raises(SlimError, match=r"^sample 40: .*expert id 4, valid ids are 0\.\.3"):
        check_routing(_batch([5], [np.full((4, 2, 2), 4, dtype=np.uint8)]), arch)
    twice = good.copy()
    twice[2, 1] = [3, 1]
    twice[3, 0] = [2, 2]
    with pytest.raises(SlimError, match=r"^sample 40: .* expert twice for token 3 in MoE layer 0: \[2, 2\]"):
        check_routing(_batch([5], [twice]), arch)


def test_replay_on_a_dense_model_is_refused(tiny_model):
    from slimrl.trainer.routing_replay import RoutingReplay

    with pytest.raises(
        SlimError, match=r"^algorithm.routing_replay=true needs an MoE model; qwen3 is dense$"
    ):
        RoutingReplay([], read_model_arch(tiny_model("qwen3")), sequence_parallel=False)


def test_driver_carries_routing_and_names_a_sample_without():
    samples = [
        Sample(index=7 + k, tokens=[3, 4, 5, 6], response_length=2, rollout_routed_experts=[[[k, 1]]] * 3)
        for k in range(2)
    ]
    parts = split_for_dp(samples, 2, routing=True)
    assert [p.sample_indices for p in parts] == [[7], [8]]
    assert [p.routed_experts[0][:, 0, 0].tolist() for p in parts if p.routed_experts] == [[0] * 3, [1] * 3]
    samples[1].rollout_routed_experts = None
    with pytest.raises(SlimError, match=r"^sample 8: algorithm.routing_replay=true but the engine returned"):
        split_for_dp(samples, 2, routing=True)


def test_backward_recompute_takes_each_micro_batch_its_own_targets():
    """Under activation recompute the router runs again in the backward (gradients on): it must get
    the targets of the micro-batch being recomputed, in forward order, not the latest ones."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from slimrl.trainer.routing_replay import EngineRouting

    replay = EngineRouting()
    RouterReplay.global_router_replay_instances.remove(replay)
    scores = torch.arange(8.0).reshape(2, 4)
    first, second = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[3, 2], [1, 0]])
    replay.recompute_in_backward = True
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def route() -> torch.Tensor:
        return replay.get_replay_topk(scores, 2, default_compute_topk=lambda s, k, **_: s.topk(k))[1]

    chosen = []
    for targets in (first, second):  # the forwards, inside the checkpoint: gradients off
        replay.set_target_indices(targets)
        with torch.no_grad():
            chosen.append(route())
    with torch.enable_grad():  # the backward's recomputes, first micro-batch first
        chosen += [route(), route()]
    assert [c.tolist() for c in chosen] == [first.tolist(), second.tolist(), first.tolist(), second.tolist()]
