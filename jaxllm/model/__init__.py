"""The device side: the Flax Qwen3 model, its paged KV cache, attention backends and weights.

Entry points: `jaxllm.model.checkpoint.load_params` (weights), `jaxllm.model.qwen3.forward`
(one step), `jaxllm.model.kv_cache.allocate_kv_cache` (the cache).
"""
