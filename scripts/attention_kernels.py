"""Paged decode attention kernels side by side on the GPU: `python scripts/attention_kernels.py`.

One layer of decode attention, 16 query heads (`--heads`; qwen3-8b has 32) / 8 kv heads of
128, bf16, each sequence's pages scattered over the pool, for several batch x context cases (a
context "LO-HI": each sequence's drawn uniformly; "R+PxLO-HI": R sequences and P rows of no
context, as a bucket's padding rows; block tables `--table-width` blocks wide, by default 16 as
in the engine with FA3 installed, where every table is as wide as max_model_len 4,096 needs):
- FlashAttention-3 (`flash-attn3-jax`) on jaxllm's layout, [pages, page_size, kv_heads, dim];
- jaxllm's Pallas decode kernels (`jaxllm.model.decode_attention`), same layout: the split one
  and the balanced one, each at the engine's programs, and the balanced one at more programs per
  multiprocessor (`--sweep programs`, the default), or the one the batch gets over its tiles and
  Triton launch settings (`launch`);
- with --jax-pallas, JAX's Pallas (Triton) paged attention,
  `jax.experimental.pallas.ops.gpu.paged_attention`, on its layout [kv_heads, pages, page_size,
  dim]. Seen on an H200 (2026-11-30): 1.1-2.1 TB/s, below FA3 at every page size.
Prints, per kernel and context, the time of one call (the median of 20 runs of one jitted
function calling it `--repeat` times, each on the last one's output: no dispatch in between),
the effective bandwidth (KV bytes read / time) and the relative error against a float32 jnp
reference.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from decode_step import timed  # scripts/decode_step.py

from jaxllm.model import decode_attention
from jaxllm.model.decode_attention import num_programs_for
from jaxllm.research.flags import at_least

KV_HEADS, DIM = 8, 128


def reference(q, keys, values, lengths):
    """[B, Hq, D] attention of q over dense [B, S, K, D] keys/values, float32."""
    group = q.shape[1] // KV_HEADS
    k = jnp.repeat(keys.astype(jnp.float32), group, axis=2)
    v = jnp.repeat(values.astype(jnp.float32), group, axis=2)
    scores = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), k) / np.sqrt(DIM)
    mask = jnp.arange(keys.shape[1])[None, None, :] < lengths[:, None, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    out = jnp.einsum("bhs,bshd->bhd", jax.nn.softmax(scores, axis=-1), v)
    return jnp.where(lengths[:, None, None] > 0, out, 0.0)  # no context: zeros


def rel_err(out, ref) -> float:
    out = out.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    cases = ["256x512", "256x1024", "256x2048", "256x100-2048", "32x1024"]
    parser.add_argument("--cases", nargs="+", default=cases, help="batch x context[-max]")
    parser.add_argument("--sweep", choices=["programs", "launch"], default="programs")
    parser.add_argument("--heads", type=at_least(KV_HEADS), default=16, help="query heads")
    parser.add_argument("--repeat", type=at_least(1), default=28, help="calls per timed run")
    parser.add_argument(
        "--table-width", type=at_least(0), default=16,
        help="blocks; 0: the power of two a case needs",
    )  # fmt: skip
    parser.add_argument("--page-sizes", type=at_least(1), nargs="+", default=[256])
    parser.add_argument("--jax-pallas", action="store_true", help="JAX's own Pallas kernel too")
    parser.add_argument(
        "--programs-per-sm", type=at_least(1), nargs="+", default=[4, 8],
        help="the balanced kernel with this many programs per multiprocessor too",
    )  # fmt: skip
    parser.add_argument(
        "--splits", type=at_least(1), nargs="*", default=[],
        help="the split kernel with this many splits a sequence too",
    )  # fmt: skip
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for case in args.cases:
        batch, contexts = case.split("x")
        counts = [int(n) for n in batch.split("+")]  # sequences, padding rows
        real, batch, *span = counts[0], sum(counts), *map(int, contexts.split("-"))
        context = -(-span[-1] // 256) * 256
        keys = jnp.asarray(rng.standard_normal((batch, context, KV_HEADS, DIM)), jnp.bfloat16)
        values = jnp.asarray(rng.standard_normal((batch, context, KV_HEADS, DIM)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((batch, args.heads, DIM)), jnp.bfloat16)
        lengths = rng.integers(span[0], span[-1] + 1, batch)
        lengths[real:] = 0
        lengths = jnp.asarray(lengths, jnp.int32)
        ref = reference(q, keys, values, lengths)
        kv_bytes = 2 * keys.nbytes * int(lengths.sum()) // keys.shape[0] // keys.shape[1]
        for page in args.page_sizes:
            per_seq = context // page
            # Scatter: page j of sequence b sits at a random place in the pool.
            order = rng.permutation(batch * per_seq).astype(np.int32)
            width = args.table_width or 1 << (per_seq - 1).bit_length()
            tables = np.zeros((batch, max(width, per_seq)), np.int32)
            tables[:, :per_seq] = order.reshape(batch, per_seq)
            pool_shape = (batch * per_seq, page, KV_HEADS, DIM)
            k_pool = (
                jnp.zeros(pool_shape, jnp.bfloat16)
                .at[order]
                .set(keys.reshape(batch * per_seq, page, KV_HEADS, DIM))
            )
            v_pool = (
                jnp.zeros(pool_shape, jnp.bfloat16)
                .at[order]
                .set(values.reshape(batch * per_seq, page, KV_HEADS, DIM))
            )
            tables = jnp.asarray(tables)
            candidates = [("fa3", {}), *jaxllm_options(args)]
            if args.jax_pallas:
                for block_k in (64, 128):
                    if block_k >= page:
                        candidates.append(("pallas", dict(ppcb=block_k // page, k_splits=1)))
            for kind, options in candidates:
                name = f"{kind} page={page} " + " ".join(f"{k}={v}" for k, v in options.items())
                try:
                    fn, operands = kernel(kind, options, q, k_pool, v_pool, tables, lengths)
                    seconds = timed(repeated(fn, args.repeat), *operands) / args.repeat
                    error = rel_err(fn(*operands), ref)
                    rows.append((case, name, seconds, kv_bytes / seconds / 1e12, error))
                except Exception as exc:  # an experiment: report and go on
                    rows.append((case, name, float("nan"), float("nan"), float("nan")))
                    print(f"{case} {name}: {type(exc).__name__}: {str(exc)[:300]}")
            del k_pool, v_pool
    print(f"\n{'case':>9s} {'kernel':50s} {'ms':>8s} {'TB/s':>6s} {'rel err':>8s}")
    for case, name, seconds, bandwidth, error in rows:
        print(f"{case:>9s} {name:50s} {seconds * 1e3:8.3f} {bandwidth:6.2f} {error:8.1e}")


def repeated(fn, times: int):
    """`fn` called `times` times in one jitted function, each on a query made of the last
    output (so that no call can be hoisted or skipped)."""

    def run(q, *operands):
        def body(_, q):
            out = fn(q, *operands).astype(jnp.float32)
            return (q.astype(jnp.float32) + 1e-3 * out).astype(q.dtype)

        return jax.lax.fori_loop(0, times, body, q)

    return jax.jit(run)


def jaxllm_options(args: argparse.Namespace) -> list[tuple[str, dict]]:
    multiprocessors = getattr(jax.devices()[0], "core_count", 0)
    programs = num_programs_for(multiprocessors)
    default = dict(num_programs=programs)
    balanced = dict(num_programs=programs // decode_attention.BALANCED_PROGRAMS_DIVISOR)
    if args.sweep == "launch":
        return [
            ("paged", dict(default, rows=rows, num_warps=warps, num_stages=stages))
            for rows in (64, 128)
            for warps in (4, 8)
            for stages in (2, 3)
        ]
    return [
        ("split", default),
        *[("split", dict(default, num_splits=n)) for n in args.splits],
        ("balanced", balanced),
        *[("balanced", dict(num_programs=multiprocessors * n)) for n in args.programs_per_sm],
    ]


def kernel(kind, options, q, k_pool, v_pool, tables, lengths):
    if kind in ("paged", "split", "balanced"):
        fn = jax.jit(
            functools.partial(getattr(decode_attention, f"{kind}_decode_attention"), **options)
        )
        return fn, (q, k_pool, v_pool, tables, lengths)
    if kind == "fa3":
        from flash_attn3_jax import flash_mha_with_kvcache

        def fa3(q, k_pool, v_pool, tables, lengths):
            out = flash_mha_with_kvcache(
                q[:, None], k_pool, v_pool, cache_seqlens=lengths, page_table=tables
            )
            return out[:, 0]

        return jax.jit(fa3), (q, k_pool, v_pool, tables, lengths)
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    # Its layout: kv heads outermost; it does not scale the scores, so q comes pre-scaled.
    q = (q.astype(jnp.float32) / np.sqrt(DIM)).astype(q.dtype)
    k_heads = jnp.transpose(k_pool, (2, 0, 1, 3))
    v_heads = jnp.transpose(v_pool, (2, 0, 1, 3))
    fn = jax.jit(
        lambda q, k, v, t, n: paged_attention(
            q,
            k,
            v,
            t,
            n,
            pages_per_compute_block=options["ppcb"],
            k_splits=options["k_splits"],
            num_warps=4,
            num_stages=2,
        )
    )
    return fn, (q, k_heads, v_heads, tables, lengths)


if __name__ == "__main__":
    main()
