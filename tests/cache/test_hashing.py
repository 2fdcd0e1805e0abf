"""Chained block hashes: pure, order- and parent-sensitive, equal for lists and arrays."""

from __future__ import annotations

import numpy as np
import xxhash

from jaxllm.cache import extend_block_hashes, hash_block


def test_hash_is_xxh64_of_parent_and_tokens():
    tokens = [1, 2, 3, 151_000]
    packed = np.array(tokens, dtype="<u4").tobytes()
    assert hash_block(None, tokens) == xxhash.xxh64_intdigest(packed)
    parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(parent, tokens) == xxhash.xxh64_intdigest(
        parent.to_bytes(8, "little") + packed
    )


def test_hash_depends_on_parent_tokens_and_order():
    root = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == root
    assert hash_block(None, np.array([1, 2, 3, 4], dtype=np.int32)) == root
    assert hash_block(None, [1, 2, 4, 3]) != root
    assert hash_block(0, [1, 2, 3, 4]) != root  # no parent differs from a parent hash of 0
    assert hash_block(root, [5, 6, 7, 8]) != hash_block(
        hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8]
    )


def test_extend_block_hashes_hashes_full_blocks_only_and_incrementally():
    tokens = np.arange(10, 21, dtype=np.int32)  # 11 tokens: 2 full blocks of 4
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens[:5], 4)
    assert hashes == [hash_block(None, [10, 11, 12, 13])]
    extend_block_hashes(hashes, tokens, 4)
    assert hashes == [hash_block(None, [10, 11, 12, 13]), hash_block(hashes[0], [14, 15, 16, 17])]
    extend_block_hashes(hashes, tokens, 4)
    assert len(hashes) == 2
