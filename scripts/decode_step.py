"""One decode step at batch 256 on the GPU, taken apart: `python scripts/decode_step.py`.

Times (median of repeated runs, device-bound loops):
- the model's decode step with a 64-block KV cache and with the full-memory cache: equal times
  show the donated cache is updated in place (a copy of ~100 GB would take ~50 ms);
- the attention kernel alone (all layers), the sampler alone, and the rest (matmuls, norms);
and prints a table. The engine's wall time per decode step comes from `bench.py`'s decode tok/s.

`--profile` also traces a few steps (model then sampler) with JAX's profiler and sums the
device's kernel time per step by kind: attention kernel, matmuls, sampler, the rest (norms,
RoPE, cache writes, merging splits). The trace gives the kernels' own times (it lists them inside
XLA's command buffers); the gap is the timed step less the kernels' sum.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.attention import attend
from jaxllm.model.checkpoint import load_params
from jaxllm.model.inputs import ModelInputs, SamplingInputs
from jaxllm.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from jaxllm.model.qwen3 import COMPILER_OPTIONS, forward
from jaxllm.model.sampler import sample
from jaxllm.platform import ATTENTION_BACKENDS, Platform
from jaxllm.research.flags import at_least


def timed(fn, *args, repeats: int = 20) -> float:
    """Median seconds of `fn(*args)` over `repeats` runs (after one warm-up)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Kinds of device work, matched in order against "kernel name | hlo op | hlo module".
KINDS = (
    ("sampler", re.compile(r"jit_sample")),
    ("attention kernel", re.compile(r"paged_decode|flash|fmha|mha_", re.IGNORECASE)),
    ("matmuls", re.compile(r"gemm|nvjet|cublas|cutlass|xmma|\bdot", re.IGNORECASE)),
    ("copies", re.compile(r"memcpy|memset", re.IGNORECASE)),
)


def kernel_seconds(trace_dir: str) -> dict[tuple[str, str, str], float]:
    """Device time of a trace's kernels, by (kernel name, hlo op, hlo module)."""
    return {key: sum(durations) for key, durations in kernel_durations(trace_dir).items()}


def kernel_durations(trace_dir: str) -> dict[tuple[str, str, str], list[float]]:
    """Each run of a trace's kernels (seconds), by (kernel name, hlo op, hlo module)."""
    from jax.profiler import ProfileData

    [path] = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    durations: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name:  # derived lines (XLA Modules, XLA Ops) repeat them
                continue
            for event in line.events:
                stats = dict(event.stats)
                key = (event.name, str(stats.get("hlo_op", "")), str(stats.get("hlo_module", "")))
                durations[key].append(event.duration_ns * 1e-9)
    return durations


def by_kind(seconds: dict[tuple[str, str, str], float]) -> dict[str, float]:
    """`kernel_seconds` summed by kind (KINDS, else "rest (fusions)")."""
    totals: dict[str, float] = collections.defaultdict(float)
    for key, total in seconds.items():
        text = " | ".join(key)
        totals[next((k for k, pattern in KINDS if pattern.search(text)), "rest (fusions)")] += total
    return totals


def profile(run, sampler, num_steps: int, step_seconds: float) -> None:
    """Traces `num_steps` of `run()` then `sampler()`; prints device time per step by kind."""
    jax.block_until_ready((run(), sampler()))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(num_steps):
            jax.block_until_ready((run(), sampler()))
    durations = kernel_durations(trace_dir)
    seconds = {key: sum(runs) for key, runs in durations.items()}
    kinds = {kind: total / num_steps for kind, total in by_kind(seconds).items()}
    print(f"\ndevice time per step (model + sampler), {num_steps} traced steps")
    for kind, total in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"{kind:40s} {total * 1e3:8.3f} ms")
    busy = sum(kinds.values())
    print(f"{'all kernels':40s} {busy * 1e3:8.3f} ms")
    gaps = (step_seconds - busy) * 1e3
    print(f"{'timed step + sampler, less kernels (gaps)':40s} {gaps:8.3f} ms")
    print("\nlargest kernels: ms per step, runs per step, us per run | name | hlo op | module")
    for key, total in sorted(seconds.items(), key=lambda item: -item[1])[:25]:
        runs = len(durations[key])
        per_step, per_run = total / num_steps * 1e3, total / runs * 1e6
        print(f"{per_step:8.3f} {runs / num_steps:6.1f} {per_run:8.1f}  {' | '.join(key)[:100]}")


def decode_inputs(contexts: np.ndarray, block_size: int, width: int, num_blocks: int):
    """A decode step of sequences of `contexts` tokens whose blocks are taken in turn from
    `num_blocks` (shared between sequences when there are too few). Each sequence writes its new
    token to a slot of its own, as the model's scatter requires (`kv_cache.write_kv`)."""
    batch = len(contexts)
    blocks_per_seq = -(-contexts // block_size)
    firsts = np.cumsum(blocks_per_seq) - blocks_per_seq
    tables = np.zeros((batch, width), np.int32)
    for row, (first, count) in enumerate(zip(firsts, blocks_per_seq, strict=True)):
        tables[row, :count] = (first + np.arange(count)) % num_blocks
    positions = (contexts - 1).astype(np.int32)
    slots = tables[np.arange(batch), positions // block_size] * block_size + positions % block_size
    if len(set(slots.tolist())) < batch:  # shared blocks: write elsewhere, one slot each
        slots = np.arange(batch)
    return ModelInputs(
        token_ids=jnp.asarray(np.arange(batch, dtype=np.int32)),
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(slots.astype(np.int32)),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(contexts, jnp.int32),
        sample_indices=jnp.arange(batch, dtype=jnp.int32),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--batch", type=at_least(1), default=256)
    parser.add_argument("--context", type=at_least(1), default=1024)
    parser.add_argument(
        "--min-context",
        type=int,
        default=None,
        help="draw each sequence's context uniformly from [this, --context] (seed 0)",
    )
    parser.add_argument(
        "--attention", choices=ATTENTION_BACKENDS, default=None, help="default: the platform's"
    )
    parser.add_argument(
        "--table-width", type=at_least(1), default=None, help="default: the engine's"
    )
    parser.add_argument("--profile", action="store_true", help="trace steps, sum kernel times")
    args = parser.parse_args()

    platform = Platform.detect()
    if args.attention:
        platform = platform.replace(attention_backend=args.attention)
    config, params = load_params(args.model, dtype=platform.dtype)
    block_size = 256
    kernels = platform.kernels(block_size, config.num_kv_heads)
    # Block tables as wide as the engine's (`start_engine`, `one_width`): with FA3 prefilling,
    # every table as wide as max_model_len (4,096) needs; else the power of two the context needs.
    width = 1 << (-(-args.context // block_size) - 1).bit_length()
    if kernels.prefill == "flash":
        width = max(width, 4096 // block_size)
    width = args.table_width or width
    contexts = np.full(args.batch, args.context)
    if args.min_context is not None:
        contexts = np.random.default_rng(0).integers(args.min_context, args.context + 1, args.batch)
    options = {**COMPILER_OPTIONS, **kernels.compiler_options(args.batch)}  # as the engine's
    step = jax.jit(forward, static_argnums=(1, 4), donate_argnums=2, compiler_options=options)
    logits = jax.random.normal(jax.random.key(1), (args.batch, config.vocab_size), jnp.float32)
    sampling = SamplingInputs(
        temperature=jnp.full((args.batch,), 0.6, jnp.float32),
        top_k=jnp.zeros((args.batch,), jnp.int32),
        top_p=jnp.ones((args.batch,), jnp.float32),
        min_p=jnp.zeros((args.batch,), jnp.float32),
        seeds=jnp.arange(args.batch, dtype=jnp.uint32),
        seed_high=jnp.zeros((args.batch,), jnp.uint32),
        steps=jnp.zeros((args.batch,), jnp.int32),
    )
    sampler = jax.jit(functools.partial(sample, mode="random"))
    rows = []

    stats = jax.devices()[0].memory_stats() or {}
    free = int(stats.get("bytes_limit", 0) * 0.85) - stats.get("bytes_in_use", 0)
    full_blocks = max(64, free // kv_cache_bytes_per_block(config, block_size))

    def run(inputs):
        logits, holder["cache"] = step(params, config, holder["cache"], inputs, kernels)
        return logits

    # Every sequence reads the same 64 blocks: the same work on either cache.
    shared = decode_inputs(contexts, block_size, width, 64)
    for num_blocks in (64, full_blocks):
        holder = {"cache": allocate_kv_cache(config, num_blocks, block_size)}
        rows.append((f"decode step, {num_blocks} KV blocks", timed(run, shared)))
    # Each sequence its own blocks, as in serving (the 64 shared ones partly sit in L2).
    if (-(-contexts // block_size)).sum() > full_blocks:
        raise SystemExit(f"{contexts.sum()} tokens do not fit {full_blocks} blocks")
    distinct = decode_inputs(contexts, block_size, width, full_blocks)
    rows.append(("decode step, distinct blocks", timed(run, distinct)))
    rows.append(("sampler (temperature 0.6)", timed(sampler, logits, sampling)))
    if args.profile:
        step_seconds = rows[-2][1] + rows[-1][1]
        profile(lambda: run(distinct), lambda: sampler(logits, sampling), 5, step_seconds)
    holder.clear()  # frees the full-memory cache

    cache = allocate_kv_cache(config, 64, block_size)
    key_pool, value_pool = cache.layer_views()
    num_heads = config.num_heads
    q = jax.random.normal(jax.random.key(0), (args.batch, num_heads, config.head_dim), jnp.bfloat16)
    attention = jax.jit(functools.partial(attend, kernels=kernels))
    one_layer = timed(attention, q.astype(key_pool.dtype), key_pool, value_pool, shared)
    layers = config.num_layers
    rows.append((f"attention ({kernels.decode}) x {layers} layers, 64 blocks", one_layer * layers))

    qwen3_recommended = sampling._replace(
        top_k=jnp.full((args.batch,), 20, jnp.int32), top_p=jnp.full((args.batch,), 0.95)
    )
    top_k_sampler = jax.jit(functools.partial(sample, mode="top-k"))
    rows.append(
        ("sampler (0.6, top_k 20, top_p 0.95)", timed(top_k_sampler, logits, qwen3_recommended))
    )

    kv_bytes = int(contexts.sum()) * kv_cache_bytes_per_block(config, 1)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    span = f"{contexts.min()}-{contexts.max()}" if args.min_context is not None else args.context
    print(f"\n{args.model}, batch {args.batch}, context {span}, {kernels}")
    print(f"bytes per step: KV {kv_bytes / 1e9:.2f} GB, weights {weight_bytes / 1e9:.2f} GB")
    print(f"bound at 4.3 TB/s: {(kv_bytes + weight_bytes) / 4.3e12 * 1e3:.2f} ms")
    for name, seconds in rows:
        print(f"{name:40s} {seconds * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
