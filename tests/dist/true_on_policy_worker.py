"""torchrun worker: the trainer's logprobs of engine-generated responses (true on-policy check).

Usage: torchrun --nproc-per-node N tests/dist/true_on_policy_worker.py OUT_DIR SAMPLES_JSON key=value ...
SAMPLES_JSON is a list of phases `{"checkpoint": HF_DIR, "samples": [{"tokens", "response_length",
"temperature"}, ...]}`. The actor is built from the first phase's checkpoint; each later phase first
loads its checkpoint into the live model (as a weight update would). Samples are scored with
`MegatronActor.response_logprobs`, grouped by temperature (the trainer scores at
`rollout.sampling.temperature`). Each rank writes OUT_DIR/rank<k>.json:
`{"logprobs": [[per-sample list or null, ...] per phase]}`.
"""

import json
import sys
from pathlib import Path

from slimrl.preflight import load_config
from slimrl.megatron_bridge.loading import load_hf_into_megatron
from slimrl.trainer.actor import MegatronActor
from slimrl.trainer.batch import TrainBatch
from slimrl.trainer.distributed import RankInfo, destroy_distributed


def score(actor: MegatronActor, samples: list[dict]) -> list[list[float] | None]:
    """Trainer logprobs of every sample (None where this rank holds no last-stage result)."""
    out: list[list[float] | None] = [None] * len(samples)
    for temperature in sorted({s["temperature"] for s in samples}):
        chosen = [i for i, s in enumerate(samples) if s["temperature"] == temperature]
        batch = TrainBatch(
            tokens=[samples[i]["tokens"] for i in chosen],
            response_lengths=[samples[i]["response_length"] for i in chosen],
            loss_masks=[[1] * samples[i]["response_length"] for i in chosen],
        )
        actor.config.rollout.sampling.temperature = temperature
        for index, values in actor.response_logprobs(batch).items():
            out[chosen[index]] = values
    return out


def main() -> None:
    out_dir, phases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    config = load_config(None, [f"model.hf_checkpoint={phases[0]['checkpoint']}", *sys.argv[3:]])
    info = RankInfo.from_env()
    actor = MegatronActor(config, info)
    actor.setup(total_steps=1)
    results = []
    for number, phase in enumerate(phases):
        if number:
            load_hf_into_megatron(actor.state.model, actor.arch, actor.layout, phase["checkpoint"])
        results.append(score(actor, phase["samples"]))
    (out_dir / f"rank{info.rank}.json").write_text(json.dumps({"logprobs": results}))
    destroy_distributed()


if __name__ == "__main__":
    main()
