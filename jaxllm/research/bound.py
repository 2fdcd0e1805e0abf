"""The physical bound on a benchmark workload's time on one H200 (the model of
shared/perf/bound.py, with the ceilings measured there)."""

from __future__ import annotations

# The H200 ceilings measured on the device (shared/PERFORMANCE.md): device copy and bf16 matmul.
H200_BANDWIDTH = 4.3e12
H200_FLOPS = 790e12


def physical_bound(
    config,
    prompt_lens,
    output_lens,
    tp=1,
    bandwidth=H200_BANDWIDTH,
    flops=H200_FLOPS,
    dtype_bytes=2,
) -> dict:
    """The lower bound on the workload's time (the model of shared/perf/bound.py).

    Decode steps read the weights once and the KV cache of every running sequence (bandwidth
    bound); prefill does the matmul and causal-attention FLOPs (compute bound).
    """
    params, step_weight_bytes, kv_bytes_per_token = model_sizes(config, tp, dtype_bytes)
    q = config.num_heads * config.head_dim
    prefill_flops = sum(prompt_lens) * 2 * params / tp
    prefill_flops += sum(2 * n * n * q * config.num_layers for n in prompt_lens) / tp
    decode_s = 0.0
    for step in range(max(output_lens)):
        context = sum(n + step for n, m in zip(prompt_lens, output_lens, strict=True) if m > step)
        decode_s += (step_weight_bytes + context * kv_bytes_per_token) / bandwidth
    total = prefill_flops / flops + decode_s
    return {"bound_s": total, "bound_tok_per_s": sum(output_lens) / total}


def model_sizes(config, tp=1, dtype_bytes=2) -> tuple[int, float, float]:
    """(the model's params, the bytes of weights a decode step reads on each device, each
    device's KV bytes a token): the LM head of a tied model is the embedding, read once."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    layer_params = d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size
    embed = config.vocab_size * d
    params = config.num_layers * layer_params + embed * (1 if config.tie_word_embeddings else 2)
    step_weight_bytes = (config.num_layers * layer_params + embed) * dtype_bytes / tp
    kv_bytes_per_token = config.num_layers * 2 * kv * dtype_bytes / tp
    return params, step_weight_bytes, kv_bytes_per_token
