"""nano-vllm's throughput benchmark, exactly, plus a JSON record and the physical bound.

`python scripts/bench.py` (or `python -m jaxllm bench`) on a GPU runs nano-vllm's workload:
seed 0, 256 sequences, prompts of randint(100, 1024) random token ids, max_tokens randint(100,
1024), temperature 0.6, ignore_eos; 133,966 output tokens. Without an accelerator it runs a small
workload on `random:qwen3-tiny` and says so.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

# The H200 ceilings measured on the device (shared/PERFORMANCE.md): device copy and bf16 matmul.
H200_BANDWIDTH = 4.3e12
H200_FLOPS = 790e12


def workload(num_seqs: int, max_input_len: int, max_output_len: int):
    """nano-vllm's bench.py workload: (prompt token ids, max_tokens), seeded with 0."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


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
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    layer_params = d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size
    embed = config.vocab_size * d
    params = config.num_layers * layer_params + embed * (1 if config.tie_word_embeddings else 2)
    step_weight_bytes = (config.num_layers * layer_params + embed) * dtype_bytes / tp
    kv_bytes_per_token = config.num_layers * 2 * kv * dtype_bytes / tp
    prefill_flops = sum(prompt_lens) * 2 * params / tp
    prefill_flops += sum(2 * n * n * q * config.num_layers for n in prompt_lens) / tp
    decode_s = 0.0
    for step in range(max(output_lens)):
        context = sum(n + step for n, m in zip(prompt_lens, output_lens, strict=True) if m > step)
        decode_s += (step_weight_bytes + context * kv_bytes_per_token) / bandwidth
    total = prefill_flops / flops + decode_s
    return {"bound_s": total, "bound_tok_per_s": sum(output_lens) / total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__)
    parser.add_argument("--model", default=None, help="default: random:qwen3-0.6b on a GPU")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--max-input-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--attention", default="auto", help="attention backend")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--num-kvcache-blocks", type=int, default=None)
    parser.add_argument("--json", default=None, help="write a JSON record here")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    import jax

    from jaxllm import LLM, SamplingParams
    from jaxllm.runner import COMPILATIONS

    on_accelerator = jax.default_backend() != "cpu"
    if on_accelerator:
        model = args.model or "random:qwen3-0.6b"
        num_seqs, max_in, max_out = 256, 1024, 1024
        engine_kwargs = {}
    else:
        model = args.model or "random:qwen3-tiny"
        num_seqs, max_in, max_out = 16, 256, 128
        engine_kwargs = {"max_num_seqs": 16, "max_model_len": 512, "max_num_batched_tokens": 2048}
        print("No accelerator: a small workload on the CPU (16 sequences), not nano-vllm's.")
    num_seqs = args.num_seqs or num_seqs
    max_in = args.max_input_len or max_in
    max_out = args.max_output_len or max_out

    llm = LLM(
        model,
        tensor_parallel_size=args.tp,
        attention_backend=args.attention,
        enable_prefix_caching=not args.no_prefix_caching,
        num_kvcache_blocks=args.num_kvcache_blocks,
        **engine_kwargs,
    )
    startup_s = time.perf_counter() - start
    prompts, max_tokens = workload(num_seqs, max_in, max_out)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)

    compilations_before = COMPILATIONS.count
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = sum(max_tokens)
    print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")

    stats = llm.last_run_stats
    bound = physical_bound(llm.model_config, [len(p) for p in prompts], max_tokens, tp=args.tp)
    record = {
        "model": model,
        "tp": args.tp,
        "num_seqs": num_seqs,
        "output_tokens": total,
        "time_s": elapsed,
        "throughput_tok_s": total / elapsed,
        "prefill_tok_s": stats.get("prefill_tok_s"),
        "decode_tok_s": stats.get("decode_tok_s"),
        "startup_s": startup_s,
        "compile_s": llm.compile_seconds,
        "num_executables": llm.num_executables,
        "compilations_during_run": COMPILATIONS.count - compilations_before,
        "num_kvcache_blocks": llm.num_kvcache_blocks,
        "attention_backend": llm.attention_backend,
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "bound_tok_s": bound["bound_tok_per_s"] if on_accelerator else None,
        "bound_ratio": (total / elapsed) / bound["bound_tok_per_s"] if on_accelerator else None,
    }
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0
