"""Chained hashes of full KV blocks, the keys of the prefix cache (pure functions).

Block i's hash covers the hash of block i - 1 and the token ids of block i, so equal hashes mean
equal prefixes, barring a 64-bit collision (which the pool's token check turns into a miss).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def pack_token_ids(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The canonical bytes of some token ids: little-endian uint32, 4 bytes per token."""
    return np.ascontiguousarray(token_ids, dtype="<u4").tobytes()


def hash_block(parent_hash: int | None, token_ids: Sequence[int] | np.ndarray) -> int:
    """The xxhash64 (an unsigned 64-bit int) of one full block's tokens chained to its parent's
    hash (None for a sequence's first block)."""
    # NOTE: a root block hashes its tokens only, so no parent value can imitate "no parent".
    parent = b"" if parent_hash is None else parent_hash.to_bytes(8, "little")
    return xxhash.xxh64_intdigest(parent + pack_token_ids(token_ids))


def extend_block_hashes(
    block_hashes: list[int], token_ids: Sequence[int] | np.ndarray, block_size: int
) -> None:
    """Appends to `block_hashes` (those of the first blocks) the hashes of the full blocks of
    `token_ids` it lacks."""
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), len(token_ids) // block_size):
        start = index * block_size
        parent = hash_block(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)
