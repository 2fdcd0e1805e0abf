"""Block-pool helpers for the cache tests: a sequence admitted as the scheduler admits one."""

from __future__ import annotations

import numpy as np

from jaxllm.cache import BlockPool, extend_block_hashes


def compute(pool: BlockPool, tokens: list[int], hashes: list[int] | None = None) -> list[int]:
    """Admits a sequence, as the scheduler does: prefix hit, allocation, then caching its full
    blocks once computed. `hashes` forges the block hashes (to provoke collisions)."""
    token_ids = np.array(tokens, dtype=np.int32)
    if hashes is None:
        hashes = []
        extend_block_hashes(hashes, token_ids, pool.block_size)
    num_full = len(tokens) // pool.block_size
    hit = pool.find_cached_prefix(token_ids, hashes, (len(tokens) - 1) // pool.block_size)
    table = pool.allocate(hit, -(-len(tokens) // pool.block_size) - len(hit))
    assert table is not None
    pool.cache_blocks(table, token_ids, hashes, len(hit), num_full)
    return table
