"""Paged decode attention as Pallas (Triton) kernels: a step's keys shared out over programs.

The "pallas" decode kernel of `attention.Kernels`; off a GPU it runs interpreted (tests). A
program reads tiles of `ROWS` consecutive cache rows of one block ([tokens, K, H] is contiguous)
as ROWS (token, kv head) keys, scores all N query heads against them in one matmul and masks each
head to its own kv head's columns; a second kernel merges the programs' partial softmax results.
How the keys are shared out depends on the batch (`paged_decode_attention`):
- `split_decode_attention`: each sequence's tiles split evenly over S programs of its own;
- `balanced_decode_attention`: the sequences' tiles laid end to end, program p of NP takes the
  p-th of NP equal ranges, which may start and end inside sequences and cross several.
NOTE: all kv heads in one program: decode is bound by the cache reads, so the masked multiply-adds
are free, while a thread block per (sequence, kv head) pays a fixed cost that dominates at short
contexts and groups of 2 query heads (FlashAttention-3; docs/performance.md).

Legend: G sequences (tiles of one token), N query heads (padded to M), K kv heads, Q query
heads per kv head, H head dim, P blocks of the pool, BS block size, W block-table width,
S key-range splits, NP programs, C segments merged at a time, HB heads per merge program.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Cache rows (token, kv head pairs) per tile; 64 x 128 bf16 = 16 KB of keys and as much values.
ROWS = 64
# Measured best of rows 64/128 x warps 4/8 x stages 2/3 on an H200 (scripts/attention_kernels.py).
NUM_WARPS, NUM_STAGES = 4, 2
# NOTE: programs the split kernel aims for, a few per multiprocessor; 2 slower with 32 query heads
# at 64 sequences on an H100, 8 slower (docs/performance.md). Interpreted (a CPU), fewer run faster.
PROGRAMS_PER_MULTIPROCESSOR = 4
DEFAULT_PROGRAMS = 4
# NOTE: a small batch's few sequences are split finely, each program a short loop: one sequence
# of 512 keys 17 us with 64 splits vs 25 with 16 (docs/performance.md).
MAX_SPLITS = 64
# NOTE: from this many sequences the balanced kernel: on an H100 a layer's attention at 128
# sequences of 500 - 2,000 tokens 0.255 vs 0.278 ms, at 64 equal, at 32 or fewer slower, its
# merge of a sequence's many segments costing more than uneven splits lose (docs/performance.md).
BALANCED_FROM_SEQUENCES = 128
# NOTE: the balanced kernel's equal ranges fill the device with half the split kernel's programs:
# with 32 query heads (8B) 12 - 16% faster on an H100, with 16 equal (docs/performance.md).
BALANCED_PROGRAMS_DIVISOR = 2
# A merge program of the balanced kernel holds C x HB x H <= this many partial outputs.
MERGE_ELEMENTS = 8192
_MASK_VALUE = -1e30


def num_programs_for(multiprocessors: int) -> int:
    """The programs a step aims for on a device of `multiprocessors` (0: unknown)."""
    return PROGRAMS_PER_MULTIPROCESSOR * multiprocessors or DEFAULT_PROGRAMS


def tile_rows(block_size: int, num_kv_heads: int, rows: int = ROWS) -> int | None:
    """The kernel's tile (cache rows) for this cache layout, or None if it has none: a power of
    two >= 16 inside one block that the kv heads (per device) divide, into a number of tokens
    that divides the block size."""
    rows = min(rows, block_size * num_kv_heads)
    if rows < 16 or rows & (rows - 1) or rows % num_kv_heads or block_size % (rows // num_kv_heads):
        return None
    return rows


def num_splits_for(
    num_sequences: int, table_width: int, block_size: int, num_kv_heads: int, num_programs: int,
    rows: int = ROWS,
) -> int:  # fmt: skip
    """Key-range splits per sequence: about `num_programs` in all, each >= 4 tiles; a power of
    two (the merge kernel's blocks are)."""
    tiles = table_width * block_size * num_kv_heads // rows
    wanted = max(1, num_programs // num_sequences)
    return 1 << (max(1, min(MAX_SPLITS, wanted, tiles // 4)).bit_length() - 1)


class _Layout(NamedTuple):
    """What the tile loop needs of the cache and the heads."""

    rows: int  # cache rows a tile
    num_kv_heads: int
    group: int  # query heads a kv head
    block_size: int
    scale: float


def _attend_tiles(q, k_ref, v_ref, block_of, context, lo, hi, *, layout: _Layout):
    """Online softmax of q [M, H] over one sequence's tiles lo .. hi - 1, its i-th block
    `block_of(i)`: (acc [M, H] float32 unnormalised, m [M] the scores' max, total [M] the sum
    of exp(score - max))."""
    rows, num_kv_heads, group, block_size, scale = layout
    tokens_per_tile = rows // num_kv_heads
    num_rows, head_dim = q.shape
    row_kv_head = lax.broadcasted_iota(jnp.int32, (num_rows, rows), 0) // group
    column = lax.broadcasted_iota(jnp.int32, (num_rows, rows), 1)
    same_head = (column % num_kv_heads) == row_kv_head

    def body(tile, carry):
        acc, m, total = carry
        first_token = tile * tokens_per_tile
        block = block_of(first_token // block_size)
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
    return lax.fori_loop(lo, jnp.maximum(lo, hi), body, (acc, m, total))


def _split_kernel(tables_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, m_ref, total_ref, *, layout):
    """Split (sequence, s)'s part: tables [W], lens [G], q [M, H], pools [P, BS * K, H] ->
    acc [M, H], m and total [M]."""
    sequence, split = pl.program_id(0), pl.program_id(1)
    context = lens_ref[sequence]
    num_tiles = pl.cdiv(context, layout.rows // layout.num_kv_heads)
    tiles_per_split = pl.cdiv(num_tiles, pl.num_programs(1))
    start = split * tiles_per_split
    end = jnp.minimum(start + tiles_per_split, num_tiles)
    block_of = lambda index: tables_ref[index]
    o_ref[...], m_ref[...], total_ref[...] = _attend_tiles(
        q_ref[...], k_ref, v_ref, block_of, context, start, end, layout=layout
    )


def _merge_splits(acc_ref, m_ref, total_ref, o_ref):
    """Merges one sequence's splits for a group of heads: acc [S, HB, H], m and total [S, HB]
    -> o [HB, H], normalised."""
    m = m_ref[...]
    weight = jnp.exp(m - m.max(axis=0)[None, :])  # [S, HB]
    total = (total_ref[...] * weight).sum(axis=0)
    out = (acc_ref[...] * weight[:, :, None]).sum(axis=0)
    o_ref[...] = (out / jnp.maximum(total, 1e-30)[:, None]).astype(o_ref.dtype)


def _balanced_kernel(
    ends_ref,  # [G] each sequence's end in the step's tiles, laid end to end
    first_ref,  # [NP] each program's first sequence
    lens_ref,  # [G] every sequence's context length
    tables_ref,  # [G, W]
    q_ref,  # [G, M, H]
    k_ref,  # [P, BS * K, H]
    v_ref,  # [P, BS * K, H]
    o_ref,  # [slots, M, H] float32: slot p + s holds program p's part of sequence s
    m_ref,  # [slots, M]
    total_ref,  # [slots, M]
    *,
    layout,
):
    program = pl.program_id(0)
    tokens_per_tile = layout.rows // layout.num_kv_heads
    num_tiles = ends_ref[ends_ref.shape[0] - 1]
    # NP = min(programs, tiles): every range holds a tile; programs past NP take none.
    programs = jnp.maximum(jnp.minimum(pl.num_programs(0), num_tiles), 1)
    begin = jnp.minimum(program * num_tiles // programs, num_tiles)
    end = jnp.minimum((program + 1) * num_tiles // programs, num_tiles)

    def segment(carry):
        """This program's tiles of one sequence, from `tile` to the range's or its end."""
        tile, sequence = carry
        context = lens_ref[sequence]
        sequence_end = ends_ref[sequence]
        sequence_begin = sequence_end - pl.cdiv(context, tokens_per_tile)
        stop = jnp.minimum(end, sequence_end)
        block_of = lambda index: tables_ref[sequence, index]
        slot = program + sequence
        o_ref[slot], m_ref[slot], total_ref[slot] = _attend_tiles(
            q_ref[sequence], k_ref, v_ref, block_of, context,
            tile - sequence_begin, stop - sequence_begin, layout=layout,
        )  # fmt: skip
        return stop, sequence + 1

    lax.while_loop(lambda carry: carry[0] < end, segment, (begin, first_ref[program]))


def _merge_segments(first_ref, count_ref, acc_ref, m_ref, total_ref, o_ref, *, chunk: int):
    """Merges one sequence's segments (slots first .. first + count - 1), `chunk` at a time, for
    a group of heads: acc [slots, HB, H], m and total [slots, HB] -> o [HB, H], normalised."""
    sequence = pl.program_id(0)
    first, count = first_ref[sequence], count_ref[sequence]
    index = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)

    def body(i, carry):
        out, m, total = carry
        slots = pl.ds(first + i * chunk, chunk)
        # Slots past the sequence's hold another's segments or nothing written: left out.
        valid = i * chunk + index < count  # [C, 1]
        m_chunk = jnp.where(valid, m_ref[slots], _MASK_VALUE)  # [C, HB]
        m_next = jnp.maximum(m, m_chunk.max(axis=0))
        weight = jnp.where(valid, jnp.exp(m_chunk - m_next[None, :]), 0.0)
        acc = jnp.where(valid[:, :, None], acc_ref[slots], 0.0)  # [C, HB, H]
        correction = jnp.exp(m - m_next)
        out = out * correction[:, None] + (acc * weight[:, :, None]).sum(axis=0)
        total = total * correction + (jnp.where(valid, total_ref[slots], 0.0) * weight).sum(axis=0)
        return out, m_next, total

    num_heads, head_dim = o_ref.shape
    out = jnp.zeros((num_heads, head_dim), jnp.float32)
    m = jnp.full((num_heads,), _MASK_VALUE, jnp.float32)
    total = jnp.zeros((num_heads,), jnp.float32)
    out, _, total = lax.fori_loop(0, pl.cdiv(count, chunk), body, (out, m, total))
    o_ref[...] = (out / jnp.maximum(total, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("num_programs", "rows", "num_warps", "num_stages", "interpret")
)
def paged_decode_attention(
    q: jax.Array,
    key_pool: jax.Array,
    value_pool: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    *,
    num_programs: int = DEFAULT_PROGRAMS,
    rows: int = ROWS,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    interpret: bool = False,
) -> jax.Array:
    """Attention of one query token per sequence over its paged context: [G, N, H] in q's dtype,
    zeros for a sequence with no context; the balanced kernel from `BALANCED_FROM_SEQUENCES`
    sequences, the split one below.

    Args:
        q: [G, N, H] the queries (bf16/f16; f32 in interpret mode).
        key_pool, value_pool: [P, BS, K, H] the cache's blocks.
        block_tables: [G, W] int32 each sequence's blocks.
        context_lens: [G] int32 keys each sequence attends to (the first ones of its blocks).
        num_programs: the split kernel's programs (`num_programs_for`), divided for the balanced.
        rows, num_warps, num_stages, interpret: the tile (cache rows), Triton's launch settings,
            and Pallas' interpreter (tests on a CPU).
    """
    balanced = q.shape[0] >= BALANCED_FROM_SEQUENCES
    kernel = balanced_decode_attention if balanced else split_decode_attention
    if balanced:
        num_programs = max(1, num_programs // BALANCED_PROGRAMS_DIVISOR)
    launch = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    args = (q, key_pool, value_pool, block_tables, context_lens)
    return kernel(*args, num_programs=num_programs, rows=rows, **launch)


def _layout(q, key_pool, rows):
    """(q padded to M heads, the pools' [P, BS * K, H] shape, the tile loop's settings)."""
    num_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, _ = key_pool.shape
    tile = tile_rows(block_size, num_kv_heads, rows)
    if tile is None:
        raise ValueError(
            f"the decode kernel has no tile for blocks of {block_size} tokens x {num_kv_heads} "
            f"kv heads per device (a power of two >= 16 cache rows that the kv heads divide, "
            f"into a number of tokens that divides the block size)"
        )
    padded_heads = max(16, pl.next_power_of_2(num_heads))
    q = jnp.pad(q, ((0, 0), (0, padded_heads - num_heads), (0, 0)))
    pool_shape = (num_blocks, block_size * num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    return q, pool_shape, _Layout(tile, num_kv_heads, group, block_size, head_dim**-0.5)


def split_decode_attention(
    q, key_pool, value_pool, block_tables, context_lens, *, num_programs=DEFAULT_PROGRAMS,
    rows=ROWS, num_warps=NUM_WARPS, num_stages=NUM_STAGES, interpret=False,
    num_splits: int | None = None,
) -> jax.Array:  # fmt: skip
    """`paged_decode_attention` over `num_splits` programs a sequence (default
    `num_splits_for`, rounded up to a power of two)."""
    num_sequences, num_heads, head_dim = q.shape
    width = block_tables.shape[1]
    q, pool_shape, layout = _layout(q, key_pool, rows)
    padded_heads = q.shape[1]
    splits = num_splits or num_splits_for(
        num_sequences, width, layout.block_size, layout.num_kv_heads, num_programs, layout.rows
    )
    splits = pl.next_power_of_2(splits)
    acc, m, total = pl.pallas_call(
        functools.partial(_split_kernel, layout=layout),
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
    most = max(1, MERGE_ELEMENTS // (splits * head_dim))
    heads_per_program = min(padded_heads, pl.next_power_of_2(most))
    out = pl.pallas_call(
        _merge_splits,
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


def balanced_decode_attention(
    q, key_pool, value_pool, block_tables, context_lens, *, num_programs=DEFAULT_PROGRAMS,
    rows=ROWS, num_warps=NUM_WARPS, num_stages=NUM_STAGES, interpret=False,
) -> jax.Array:  # fmt: skip
    """`paged_decode_attention` over `num_programs` programs taking equal ranges of the
    sequences' tiles laid end to end."""
    num_sequences, num_heads, head_dim = q.shape
    width = block_tables.shape[1]
    q, pool_shape, layout = _layout(q, key_pool, rows)
    padded_heads = q.shape[1]
    # The schedule (as the kernel computes it): program p takes tiles [p T // NP, (p + 1) T //
    # NP) of the T laid end to end, NP = min(num_programs, T), and writes its part of sequence s
    # to slot p + s; a sequence's parts are those of the programs holding its first to last tile.
    tiles = -(-context_lens // (layout.rows // layout.num_kv_heads))
    ends = jnp.cumsum(tiles, dtype=jnp.int32)
    num_tiles = ends[-1]
    programs = jnp.maximum(jnp.minimum(num_programs, num_tiles), 1)
    begins = jnp.arange(num_programs, dtype=jnp.int32) * num_tiles // programs
    first = jnp.searchsorted(ends, begins, side="right", method="compare_all")
    first = jnp.minimum(first, num_sequences - 1).astype(jnp.int32)
    first_program = ((ends - tiles + 1) * programs - 1) // jnp.maximum(num_tiles, 1)
    last_program = (ends * programs - 1) // jnp.maximum(num_tiles, 1)
    count = jnp.where(tiles > 0, last_program - first_program + 1, 0)
    first_slot = first_program + jnp.arange(num_sequences, dtype=jnp.int32)
    # NOTE: a merge program merges C segments of HB heads at a time, C x HB x H partial outputs
    # (`MERGE_ELEMENTS`); the slots run C past the last so that its reads stay inside.
    heads_per_merge = min(padded_heads, 8)
    chunk = 1 << max(0, (MERGE_ELEMENTS // (heads_per_merge * head_dim)).bit_length() - 1)
    slots = num_programs + num_sequences + chunk
    whole = lambda *shape: pl.BlockSpec(shape, lambda p: (0,) * len(shape))
    acc, m, total = pl.pallas_call(
        functools.partial(_balanced_kernel, layout=layout),
        grid=(num_programs,),
        in_specs=[
            whole(num_sequences),
            whole(num_programs),
            whole(num_sequences),
            whole(num_sequences, width),
            whole(num_sequences, padded_heads, head_dim),
            whole(*pool_shape),
            whole(*pool_shape),
        ],
        out_specs=[whole(slots, padded_heads, head_dim), *[whole(slots, padded_heads)] * 2],
        out_shape=[
            jax.ShapeDtypeStruct((slots, padded_heads, head_dim), jnp.float32),
            *[jax.ShapeDtypeStruct((slots, padded_heads), jnp.float32)] * 2,
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxllm_balanced_decode",
    )(
        ends, first, context_lens, block_tables, q,
        key_pool.reshape(pool_shape), value_pool.reshape(pool_shape),
    )  # fmt: skip
    out = pl.pallas_call(
        functools.partial(_merge_segments, chunk=chunk),
        grid=(num_sequences, padded_heads // heads_per_merge),
        in_specs=[
            pl.BlockSpec((num_sequences,), lambda s, j: (0,)),
            pl.BlockSpec((num_sequences,), lambda s, j: (0,)),
            pl.BlockSpec((slots, heads_per_merge, head_dim), lambda s, j: (0, j, 0)),
            *[pl.BlockSpec((slots, heads_per_merge), lambda s, j: (0, j))] * 2,
        ],
        out_specs=pl.BlockSpec((None, heads_per_merge, head_dim), lambda s, j: (s, j, 0)),
        out_shape=jax.ShapeDtypeStruct((num_sequences, padded_heads, head_dim), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="jaxllm_merge_segments",
    )(first_slot, count, acc, m, total)
    return out[:, :num_heads]
