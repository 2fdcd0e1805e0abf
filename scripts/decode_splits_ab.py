"""A script run with the Pallas decode kernel's key splits chosen by one rule or another, for an
A/B on the GPU (docs/performance.md): `python scripts/decode_splits_ab.py RULE SCRIPT [flags]`,
SCRIPT one of bench (scripts/bench.py), decode_step, profile_host, with its own flags.

Rules:
- even: the default (`num_splits_for`), min(16, 512 // G, tiles // 4) programs per sequence,
  each an equal share of its tiles;
- fixed: programs of `fixed_split_tiles` tiles each, as many per sequence as its context needs.
  Faster for one layer (scripts/attention_kernels.py) and for a decode step (decode_step.py
  --min-context) of mixed contexts with tables 8 blocks wide, slower in bench.py, whose tables
  are 16 wide (docs/performance.md): the rule reads the width, so the benchmark's programs were
  twice as large;
- per-batch: programs of `per_batch_split_tiles` tiles, from the batch size alone (the best
  sizes of scripts/attention_kernels.py's sweep at 64, 128 and 256 sequences). In bench.py its
  decode steps were no faster than the even split's (6.07 vs 6.09 ms, docs/performance.md).
"""

from __future__ import annotations

import functools
import sys

from jaxllm.model import decode_attention


def table_tiles(width: int, block_size: int, num_kv_heads: int) -> int:
    """Tiles of the kernel's tile (`decode_attention.tile_rows`) in a table of `width` blocks."""
    return width * block_size * num_kv_heads // decode_attention.tile_rows(block_size, num_kv_heads)


def power_of_two_tiles(wanted: int, tiles: int) -> int:
    """The power of two at most `wanted`, at least 16 tiles, at most `tiles` (a whole table)."""
    return min(tiles, max(16, 1 << max(wanted, 1).bit_length() - 1))


def fixed_split_tiles(num_sequences: int, width: int, block_size: int, num_kv_heads: int) -> int:
    """About 512 programs when the contexts fill half their tables on average."""
    tiles = table_tiles(width, block_size, num_kv_heads)
    return power_of_two_tiles(num_sequences * tiles // (2 * 512), tiles)


def per_batch_split_tiles(num_sequences: int, width: int, block_size: int, num_kv_heads: int):
    """G / 4 tiles: 512 programs when the contexts average 1,024 tokens (128 tiles of 8)."""
    return power_of_two_tiles(num_sequences // 4, table_tiles(width, block_size, num_kv_heads))


def with_split_tiles(paged_decode_attention, split_tiles_for):
    @functools.wraps(paged_decode_attention)
    def attend(q, key_pool, value_pool, block_tables, context_lens, **options):
        _, block_size, num_kv_heads, _ = key_pool.shape
        tiles = split_tiles_for(*block_tables.shape, block_size, num_kv_heads)
        return paged_decode_attention(
            q, key_pool, value_pool, block_tables, context_lens, split_tiles=tiles, **options
        )

    return attend


RULES = {"fixed": fixed_split_tiles, "per-batch": per_batch_split_tiles}


if __name__ == "__main__":
    rule, script, *flags = sys.argv[1:]
    if script == "bench":
        from jaxllm.bench import main
    elif script == "decode_step":
        from decode_step import main  # scripts/decode_step.py
    elif script == "profile_host":
        from profile_host import main
    else:
        sys.exit(f"unknown script {script!r}: bench, decode_step or profile_host")
    if rule in RULES:
        decode_attention.paged_decode_attention = with_split_tiles(
            decode_attention.paged_decode_attention, RULES[rule]
        )
    elif rule != "even":
        sys.exit(f"unknown rule {rule!r}: even, fixed or per-batch")
    sys.argv = [sys.argv[0], *flags]
    sys.exit(main())
