"""The decoder layers as a loop on the device rather than unrolled, one forward pass timed:
`python scripts/layer_loop.py [--batch 1 256] [--context 512]`.

The engine unrolls the layers, so a forward pass's CUDA graph holds every layer's kernels
(~400 at qwen3-0.6b) and each call launches them all from the host. Here the same forward pass
also runs its layers as a `fori_loop` over stacked weights, the loop inside the CUDA graph
(`LOOP_COMMAND_BUFFERS`), and unrolled over slices of the stacked weights; each with and
without XLA's dynamic-slice fusion (a GEMM reading its layer's weights in place rather than
from a copy). For each variant and batch: its first call (compiling), the call's host time with
the device idle (median), the wall time per call of 100 calls queued back to back, the device
time of its kernels (traced), and the logits' largest difference from the unrolled pass. Then
the same for a program of `STEPS` greedy decode steps (a multi-step plan's loop), unrolled layers
against the layer loop nested in the step loop; its times per step, its diff in tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from decode_step import decode_inputs, kernel_durations
from jax import lax

from jaxllm.model.checkpoint import load_params
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.layers import RMSNorm, embed_tokens, rotary_cos_sin
from jaxllm.model.qwen3 import COMPILER_OPTIONS, _apply_layer, forward
from jaxllm.platform import Platform
from jaxllm.research.flags import at_least

# Decode steps of the multi-step variants (a plan's, on a GPU).
STEPS = 8


def looped_forward(params, config, kv_cache, inputs, kernels):
    """`forward` (tied embeddings, one device) with its layers as a loop over stacked weights."""
    x = embed_tokens(params["embed"], inputs.token_ids, 1).astype(jnp.float32)
    cos, sin = rotary_cos_sin(inputs.positions, config.head_dim, config.rope_theta)

    def layer(i, carry):
        x, kv_cache = carry
        weights = jax.tree.map(lambda w: w[i], params["layers"])
        return _apply_layer(config, 1, kernels, weights, x, kv_cache, i, cos, sin, inputs)

    x, kv_cache = lax.fori_loop(0, config.num_layers, layer, (x, kv_cache))
    norm = RMSNorm(config.rms_norm_eps, config.jnp_dtype)
    x = norm.apply({"params": params["final_norm"]}, x[inputs.sample_indices])
    logits = jnp.einsum("SD,VD->SV", x, params["embed"], preferred_element_type=jnp.float32)
    return logits, kv_cache


def sliced_forward(params, config, kv_cache, inputs, kernels):
    """`forward` unrolled over stacked weights, each layer's a static slice of them."""
    layers = params["layers"]
    params = {key: value for key, value in params.items() if key != "layers"}
    for i in range(config.num_layers):
        params[f"layers_{i}"] = jax.tree.map(lambda w, i=i: w[i], layers)
    return forward(params, config, kv_cache, inputs, kernels)


def stepped(fn, steps: int):
    """`steps` greedy decode steps of `fn` in one program (a loop, as a multi-step plan's),
    each feeding its tokens to the next: (params, config, kv_cache, inputs, kernels) ->
    (the last step's tokens, kv_cache)."""

    def run(params, config, kv_cache, inputs, kernels):
        def step(_, carry):
            kv_cache, tokens = carry
            logits, kv_cache = fn(
                params, config, kv_cache, inputs._replace(token_ids=tokens), kernels
            )
            return kv_cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        kv_cache, tokens = lax.fori_loop(0, steps, step, (kv_cache, inputs.token_ids))
        return tokens, kv_cache

    return run


def times(run, inputs, calls: int = 100) -> tuple[float, float]:
    """Median host ms of a call with the device idle; wall ms per call of `calls` queued."""
    idle = []
    for _ in range(30):
        jax.block_until_ready(run(inputs))
        start = time.perf_counter()
        logits = run(inputs)
        idle.append(time.perf_counter() - start)
        jax.block_until_ready(logits)
    start = time.perf_counter()
    for _ in range(calls):
        logits = run(inputs)
    jax.block_until_ready(logits)
    return 1e3 * float(np.median(idle)), 1e3 * (time.perf_counter() - start) / calls


def kernel_ms(run, inputs, calls: int = 5) -> float:
    """Device ms of the kernels of one call, from a trace of `calls` calls."""
    jax.block_until_ready(run(inputs))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            jax.block_until_ready(run(inputs))
    seconds = sum(sum(runs) for runs in kernel_durations(trace_dir).values())
    return 1e3 * seconds / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--batch", type=at_least(1), nargs="+", default=[1, 256])
    parser.add_argument("--context", type=at_least(1), default=512)
    args = parser.parse_args()

    platform = Platform.detect()
    config, params = load_params(args.model, dtype=platform.dtype)
    if not config.tie_word_embeddings:
        raise SystemExit("the looped forward here takes tied embeddings")
    block_size = 256
    num_blocks = max(args.batch) * -(-args.context // block_size)  # a block of its own each
    kernels = platform.kernels(block_size, config.num_kv_heads)
    layers = [params.pop(f"layers_{i}") for i in range(config.num_layers)]
    stacked = {**params, "layers": jax.tree.map(lambda *ws: jnp.stack(ws), *layers)}
    params = {**params, **{f"layers_{i}": layer for i, layer in enumerate(layers)}}
    width = max(1 << (-(-args.context // block_size) - 1).bit_length(), 4096 // block_size)
    holder = {"cache": allocate_kv_cache(config, num_blocks, block_size)}

    print(f"{args.model}, context {args.context}, {kernels}")
    header = ("variant", "batch", "compile s", "idle call ms", "queued ms", "kernels ms", "diff")
    print("{:36s} {:>5s} {:>9s} {:>12s} {:>10s} {:>10s} {:>9s}".format(*header))
    for batch in args.batch:
        inputs = decode_inputs(np.full(batch, args.context), block_size, width, num_blocks)
        options = {**COMPILER_OPTIONS, **kernels.compiler_options(batch)}
        loop_options = {**COMPILER_OPTIONS, **kernels.compiler_options(batch, loop=True)}
        if not platform.nvidia:
            loop_options = options
        fused = {"xla_gpu_enable_dynamic_slice_fusion": True} if platform.nvidia else {}
        # NOTE: the telling ones first, for a run cut short.
        variants = [
            ("unrolled", forward, params, options, 1),
            ("loop in graph, slice fusion", looped_forward, stacked, loop_options | fused, 1),
            ("loop in graph", looped_forward, stacked, loop_options, 1),
            (f"{STEPS} steps, unrolled", forward, params, loop_options, STEPS),
            (f"{STEPS} steps, loop, slice fusion", looped_forward, stacked, loop_options | fused,
             STEPS),
            ("unrolled, stacked weights", sliced_forward, stacked, options, 1),
            ("unrolled, stacked, slice fusion", sliced_forward, stacked, options | fused, 1),
            ("loop from the host", looped_forward, stacked, options, 1),
        ]  # fmt: skip
        references = {}
        for name, fn, weights, compile_options, steps in variants:
            step = jax.jit(fn if steps == 1 else stepped(fn, steps), static_argnums=(1, 4),
                           donate_argnums=2, compiler_options=compile_options)  # fmt: skip

            def run(inputs, step=step, weights=weights):
                out, holder["cache"] = step(weights, config, holder["cache"], inputs, kernels)
                return out

            try:
                start = time.perf_counter()
                out = np.asarray(run(inputs))
                compile_s = time.perf_counter() - start
                idle, queued = times(run, inputs)
                device = kernel_ms(run, inputs)
            except Exception as error:  # a variant XLA refuses is a row
                print(f"{name:36s} {batch:5d} failed: {str(error).splitlines()[0][:120]}")
                holder["cache"] = allocate_kv_cache(config, num_blocks, block_size)  # donated
                continue
            reference = references.setdefault(steps, out)
            diff = float(np.abs(out - reference).max())
            queued, device = queued / steps, device / steps
            figures = f"{compile_s:9.1f} {idle:12.3f} {queued:10.3f} {device:10.3f} {diff:9.2e}"
            print(f"{name:36s} {batch:5d} {figures}")


if __name__ == "__main__":
    main()
