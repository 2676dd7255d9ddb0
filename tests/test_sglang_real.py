"""Real SGLang 0.5.23 on CPU, started by slimrl's own launch code (`rollout.engine=sglang`)."""

from __future__ import annotations

import requests

from slimrl.compat.sglang_cpu import SGLANG_RELEASE, check_sglang_version
from tests.engines import running_engines


def test_installed_sglang_is_the_pinned_referee() -> None:
    assert check_sglang_version() == SGLANG_RELEASE


def test_real_sglang_serves_greedy_tokens_and_logprobs_on_cpu(tiny_model, tmp_path) -> None:
    model = tiny_model("qwen3_moe")
    with running_engines("sglang", model, tmp_path) as (url,):
        info = requests.get(f"{url}/get_model_info", timeout=30).json()
        assert info["model_type"] == "qwen3_moe"
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_logprob": True}  # fmt: skip
        out = requests.post(f"{url}/generate", json=body, timeout=60).json()
        assert len(out["output_ids"]) == 4
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        logprobs = out["meta_info"]["output_token_logprobs"]
        assert [row[1] for row in logprobs] == out["output_ids"]
        assert all(row[0] < 0 for row in logprobs)
