"""The embedded rollout engine: an SGLang-compatible HTTP server around a transformers model (CPU).

On GPU clusters the rollout fleet is real SGLang servers. On a CPU machine the same client code talks
to `slimrl serve` instead, so everything above the HTTP API (router, rollout loop, weight sync) runs
unchanged in tests. Modules:

* `engine`: continuous-batching scheduler with a left-padded KV cache (one decode forward per step);
* `sampling`: per-request sampling parameters and the batched sampler;
* `kv_cache`: the running batch's KV cache (merge on admission, compaction on exit);
* `weights`: HF-named tensors -> live parameters (fused MoE experts, tied embeddings);
* `tensor_transport`: shared-memory tensor payloads and the gloo weight-update group (trainer side too);
* `protocol`: SGLang request parsing / response shapes; `server`: the aiohttp app.

Heavy imports (torch, transformers) happen in those modules, not here.
"""
