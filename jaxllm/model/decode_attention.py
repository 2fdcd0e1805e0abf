"""Paged decode attention as a Pallas (Triton) kernel: one program per sequence and key range.

The "pallas" decode kernel of `attention.Kernels`; off a GPU it runs interpreted (tests). A
program reads a tile of `ROWS` consecutive cache rows of one block ([tokens, K, H] is
contiguous) as ROWS (token, kv head) keys, scores all N query heads against them in one matmul
and masks each head to its own kv head's columns. Long contexts are split over `num_splits`
programs whose partial softmax results a second kernel merges (`_merge_kernel`).
NOTE: all kv heads in one program: decode is bound by the cache reads, so the masked multiply-adds
are free, while a thread block per (sequence, kv head) pays a fixed cost that dominates at short
contexts and groups of 2 query heads (FlashAttention-3; docs/performance.md).

Legend: G sequences (tiles of one token), N query heads (padded to M), K kv heads, Q query
heads per kv head, H head dim, P blocks of the pool, BS block size, W block-table width,
S key-range splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Cache rows (token, kv head pairs) per tile; 64 x 128 bf16 = 16 KB of keys and as much values.
ROWS = 64
# Measured best of rows 64/128 x warps 4/8 x stages 2/3 on an H200 (scripts/attention_kernels.py).
NUM_WARPS, NUM_STAGES = 4, 2
# Aim for this many programs per step (the H200 has 132 multiprocessors).
TARGET_PROGRAMS = 512
# NOTE: a small batch's few sequences are split finely, each program a short loop: one sequence
# of 512 keys 17 us with 64 splits vs 25 with 16 (docs/performance.md).
MAX_SPLITS = 64
_MASK_VALUE = -1e30


def _decode_kernel(
    tables_ref,  # [W] this sequence's blocks
    lens_ref,  # [G] every sequence's context length
    q_ref,  # [M, H]
    k_ref,  # [P, BS * K, H]
    v_ref,  # [P, BS * K, H]
    o_ref,  # [M, H] float32, unnormalised
    m_ref,  # [M] the scores' running max
    total_ref,  # [M] the running sum of exp(score - max)
    *,
    rows: int,
    num_kv_heads: int,
    group: int,
    block_size: int,
    scale: float,
):
    sequence, split = pl.program_id(0), pl.program_id(1)
    tokens_per_tile = rows // num_kv_heads
    num_rows, head_dim = q_ref.shape
    context = lens_ref[sequence]
    num_tiles = pl.cdiv(context, tokens_per_tile)
    tiles_per_split = pl.cdiv(num_tiles, pl.num_programs(1))
    start = split * tiles_per_split
    end = jnp.minimum(start + tiles_per_split, num_tiles)

    q = q_ref[...]
    row_kv_head = lax.broadcasted_iota(jnp.int32, (num_rows, rows), 0) // group
    column = lax.broadcasted_iota(jnp.int32, (num_rows, rows), 1)
    same_head = (column % num_kv_heads) == row_kv_head

    def body(tile, carry):
        acc, m, total = carry
        first_token = tile * tokens_per_tile
        block = tables_ref[first_token // block_size]
        row = pl.multiple_of((first_token % block_size) * num_kv_heads, rows)
        k = k_ref[block, pl.ds(row, rows), :]  # [rows, H]
        v = v_ref[block, pl.ds(row, rows), :]
        scores = plgpu.dot(q, k, trans_b=True) * scale  # [M, rows] float32
        visible = same_head & (first_token + column // num_kv_heads < context)
        scores = jnp.where(visible, scores, _MASK_VALUE)
        m_next = jnp.maximum(m, scores.max(axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(scores - m_next[:, None])
        total = total * correction + p.sum(axis=1)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_next, total

    acc = jnp.zeros((num_rows, head_dim), jnp.float32)
    m = jnp.full((num_rows,), _MASK_VALUE, jnp.float32)
    total = jnp.zeros((num_rows,), jnp.float32)
    carry = lax.fori_loop(start, jnp.maximum(start, end), body, (acc, m, total))
    o_ref[...], m_ref[...], total_ref[...] = carry


def _merge_kernel(acc_ref, m_ref, total_ref, o_ref):
    """Merges one sequence's splits for a group of heads: acc [S, HB, H], m and total [S, HB]
    -> o [HB, H], normalised."""
    m = m_ref[...]
    weight = jnp.exp(m - m.max(axis=0)[None, :])  # [S, HB]
    total = (total_ref[...] * weight).sum(axis=0)
    out = (acc_ref[...] * weight[:, :, None]).sum(axis=0)
    o_ref[...] = (out / jnp.maximum(total, 1e-30)[:, None]).astype(o_ref.dtype)


def tile_rows(block_size: int, num_kv_heads: int, rows: int = ROWS) -> int | None:
    """The kernel's tile (cache rows) for this cache layout, or None if it has none: a power of
    two >= 16 inside one block that the kv heads (per device) divide, into a number of tokens
    that divides the block size."""
    rows = min(rows, block_size * num_kv_heads)
    if rows < 16 or rows & (rows - 1) or rows % num_kv_heads or block_size % (rows // num_kv_heads):
        return None
    return rows


def num_splits_for(
    num_sequences: int, table_width: int, block_size: int, num_kv_heads: int, rows: int = ROWS
) -> int:
    """Key-range splits per sequence: enough programs to fill the GPU, each >= 4 tiles; a
    power of two (the merge kernel's blocks are)."""
    tiles = table_width * block_size * num_kv_heads // rows
    wanted = max(1, TARGET_PROGRAMS // num_sequences)
    return 1 << (max(1, min(MAX_SPLITS, wanted, tiles // 4)).bit_length() - 1)


@functools.partial(
    jax.jit,
    static_argnames=("num_splits", "rows", "num_warps", "num_stages", "interpret"),
)
def paged_decode_attention(
    q: jax.Array,
    key_pool: jax.Array,
    value_pool: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    num_splits: int | None = None,
    rows: int = ROWS,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    interpret: bool = False,
) -> jax.Array:
    """Attention of one query token per sequence over its paged context: [G, N, H] in q's dtype,
    zeros for a sequence with no context.

    Args:
        q: [G, N, H] the queries (bf16/f16; f32 in interpret mode).
        key_pool, value_pool: [P, BS, K, H] the cache's blocks.
        block_tables: [G, W] int32 each sequence's blocks.
        context_lens: [G] int32 keys each sequence attends to (the first ones of its blocks).
        num_splits: programs per sequence (default `num_splits_for`), rounded up to a power
            of two.
        rows, num_warps, num_stages, interpret: the tile (cache rows), Triton's launch settings,
            and Pallas' interpreter (tests on a CPU).
    """
    num_sequences, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_pool.shape
    width = block_tables.shape[1]
    rows = tile_rows(block_size, num_kv_heads, rows)
    if rows is None:
        raise ValueError(
            f"the decode kernel has no tile for blocks of {block_size} tokens x {num_kv_heads} "
            f"kv heads per device (a power of two >= 16 cache rows that the kv heads divide, "
            f"into a number of tokens that divides the block size)"
        )
    splits = num_splits or num_splits_for(num_sequences, width, block_size, num_kv_heads, rows)
    splits = pl.next_power_of_2(splits)
    padded_heads = max(16, pl.next_power_of_2(num_heads))
    q = jnp.pad(q, ((0, 0), (0, padded_heads - num_heads), (0, 0)))
    pool_shape = (num_blocks, block_size * num_kv_heads, head_dim)
    kernel = functools.partial(
        _decode_kernel,
        rows=rows,
        num_kv_heads=num_kv_heads,
        group=num_heads // num_kv_heads,
        block_size=block_size,
        scale=head_dim**-0.5,
    )
    acc, m, total = pl.pallas_call(
        kernel,
        grid=(num_sequences, splits),
        in_specs=[
            pl.BlockSpec((None, width), lambda g, s: (g, 0)),
            pl.BlockSpec((num_sequences,), lambda g, s: (0,)),
            pl.BlockSpec((None, padded_heads, head_dim), lambda g, s: (g, 0, 0)),
            pl.BlockSpec(pool_shape, lambda g, s: (0, 0, 0)),
            pl.BlockSpec(pool_shape, lambda g, s: (0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, padded_heads, head_dim), lambda g, s: (g, s, 0, 0)),
            *[pl.BlockSpec((None, None, padded_heads), lambda g, s: (g, s, 0))] * 2,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_sequences, splits, padded_heads, head_dim), jnp.float32),
            *[jax.ShapeDtypeStruct((num_sequences, splits, padded_heads), jnp.float32)] * 2,
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxllm_paged_decode",
    )(block_tables, context_lens, q, key_pool.reshape(pool_shape), value_pool.reshape(pool_shape))
    # NOTE: one launch, where XLA's merge took four fusions (docs/performance.md); a program
    # merges HB heads of one sequence, HB x S x H <= 8K partial outputs.
    most = max(1, 8192 // (splits * head_dim))
    heads_per_program = min(padded_heads, pl.next_power_of_2(most))
    out = pl.pallas_call(
        _merge_kernel,
        grid=(num_sequences, padded_heads // heads_per_program),
        in_specs=[
            pl.BlockSpec((None, splits, heads_per_program, head_dim), lambda g, j: (g, 0, j, 0)),
            *[pl.BlockSpec((None, splits, heads_per_program), lambda g, j: (g, 0, j))] * 2,
        ],
        out_specs=pl.BlockSpec((None, heads_per_program, head_dim), lambda g, j: (g, j, 0)),
        out_shape=jax.ShapeDtypeStruct((num_sequences, padded_heads, head_dim), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="jaxllm_merge_splits",
    )(acc, m, total)
    return out[:, :num_heads]
