"""torchrun worker for PPO with a critic: build the tiny policy and its value model, run a scenario.

Usage: torchrun --nproc-per-node N tests/dist/ppo_worker.py OUT_DIR SCENARIO key=value ...
Scenarios:
  `steps`     two `train_rl` calls (GAE on the critic's values, critic and policy updates);
  `head`      a random value head: the critic's values against hidden @ w + b computed by hand from
              the policy's final hidden states (same body), one rank;
  `unfused`   one step as `steps`, then a critic step after a separate forward-only value pass
              (what steps_per_rollout > 1 does), to compare with the fused second step of `steps`;
  `save`      one step, checkpoint into OUT_DIR/ckpt, then a second step;
  `resume`    load the checkpoint named by the argument `--from=DIR`, then one step;
  `load_critic` digest of the critic built with `critic.load=...`.
Each rank writes OUT_DIR/rank<k>.json.
"""

import hashlib
import json
import random
import sys
from pathlib import Path

import torch

from slimrl.preflight import load_config
from slimrl.trainer import ppo
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import PerToken, TrainBatch
from slimrl.trainer.checkpoint import load_train_state, save_train_state
from slimrl.trainer.distributed import RankInfo, destroy_distributed

NUM = 8


def batch_spec(vocab: int) -> list[dict]:
    """Eight samples: random tokens, rewards 0/1 (and one 0.5), one multi-turn loss-mask hole."""
    rng = random.Random(0)
    spec = []
    for i in range(NUM):
        tokens = [rng.randrange(3, vocab) for _ in range(rng.randrange(10, 30))]
        response = rng.randrange(3, len(tokens) - 2)
        mask = [1] * response
        if i == 3:  # a tool observation inside the response: not an action
            mask[1] = 0
        spec.append({"tokens": tokens, "response": response, "mask": mask, "reward": [1.0, 0.0, 0.5][i % 3]})
    return spec


def make_batch(vocab: int, dp: int, dp_rank: int) -> TrainBatch:
    spec = batch_spec(vocab)
    mine = [spec[i] for i in range(dp_rank, NUM, dp)]
    return TrainBatch(
        tokens=[s["tokens"] for s in mine],
        response_lengths=[s["response"] for s in mine],
        loss_masks=[s["mask"] for s in mine],
        per_token=PerToken(scores=[[s["reward"]] * s["response"] for s in mine]),  # the driver's score
        global_num_tokens=sum(sum(s["mask"]) for s in spec),
        global_num_seqs=NUM,
    )


def digest(chunks) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        for _, p in sorted(chunk.module.named_parameters()):
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def head_check(actor: MegatronActor, batch: TrainBatch) -> dict:
    """Values of a random head vs. the same head applied by hand to the policy's hidden states."""
    critic = actor.critic
    generator = torch.Generator().manual_seed(7)
    head = critic.state.model[-1].module.output_layer
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.3)
        head.bias.fill_(0.25)
    policy = actor.state.model[-1].module
    hidden: list[torch.Tensor] = []
    hook = policy.output_layer.register_forward_pre_hook(lambda m, args: hidden.append(args[0].detach()))
    tokens = torch.tensor([batch.tokens[0]])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        policy(tokens, positions, None)
    hook.remove()
    by_hand = (hidden[0][:, 0, :].double() @ head.weight.double().T + head.bias.double()).squeeze(-1)
    values = critic.values(actor, batch.select([0]))[0]
    n, r = len(batch.tokens[0]), batch.response_lengths[0]
    expected = by_hand[n - r - 1 : n - 1].tolist()  # the state before each response token
    return {"values": values, "by_hand": expected}


def main() -> None:
    out_dir, scenario = Path(sys.argv[1]), sys.argv[2]
    sources = [Path(a.split("=", 1)[1]) for a in sys.argv[3:] if a.startswith("--from=")]
    config = load_config(None, [a for a in sys.argv[3:] if not a.startswith("--from=")])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=4)
    coords = actor.coordinates()
    result: dict = {"coords": coords, "metrics": [], "spec": batch_spec(actor.arch.vocab_size)}

    def batch() -> TrainBatch:
        return make_batch(actor.arch.vocab_size, actor.layout.dp, coords["dp"])

    def step() -> None:
        before = (digest(actor.state.model), digest(actor.critic.state.model))
        metrics = actor.train_rl(batch())
        after = (digest(actor.state.model), digest(actor.critic.state.model))
        metrics["policy_changed"] = before[0] != after[0]
        metrics["critic_changed"] = before[1] != after[1]
        metrics["digests_after"] = after  # this rank's shards: Adam state decides them
        result["metrics"].append(metrics)

    if scenario == "head":
        result["head"] = head_check(actor, batch())
    elif scenario == "steps":
        step()
        step()
    elif scenario == "unfused":
        step()
        b = batch()
        actor.steps_done += 1
        b.per_token.token_rewards = ppo.token_rewards(actor, b)
        ppo.separate_value_pass(actor, b)
        metrics, _ = actor.critic.train_step(actor, b, fused=False)
        result["metrics"].append(metrics)
    elif scenario == "save":
        step()
        result["critic_at_save"] = digest(actor.critic.state.model)
        (out_dir / "ckpt").mkdir(exist_ok=True)
        save_train_state(actor, out_dir / "ckpt")
        step()
    elif scenario == "resume":
        load_train_state(actor, sources[0])
        step()
    elif scenario == "load_critic":  # critic.load=...: only the value model's weights
        result["critic_at_start"] = digest(actor.critic.state.model)
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
