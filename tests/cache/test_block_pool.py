"""BlockPool scenarios with exact block ids, ref counts and hashes (block size 4)."""

from __future__ import annotations

import numpy as np
import pytest
from support.blocks import compute

from jaxllm.cache import BlockPool, IntegrityError, LRUPolicy, extend_block_hashes, hash_block


def make_pool(num_blocks: int = 8, **kwargs) -> BlockPool:
    return BlockPool(num_blocks, 4, **kwargs)


def refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def state(pool: BlockPool) -> tuple[int, int, int]:
    stats = pool.stats()
    return stats.num_used_blocks, stats.num_cached_free_blocks, stats.num_empty_blocks


def test_fresh_blocks_come_in_order_and_return_to_the_empty_list():
    pool = make_pool()
    table = pool.allocate([], 3)
    assert table == [0, 1, 2] and refs(pool)[:4] == [1, 1, 1, 0]
    pool.check_integrity([table])
    pool.free(table)
    assert state(pool) == (0, 0, 8) and pool.allocate([], 1) == [0]


def test_allocate_and_append_slots_refuse_without_mutating():
    pool = make_pool(4)
    table = pool.allocate([], 3)
    assert pool.allocate([], 2) is None and state(pool) == (3, 0, 1)
    assert pool.append_slots(table, 12) and table == [0, 1, 2]  # already holds 12 tokens
    assert not pool.append_slots(table, 17) and table == [0, 1, 2]  # needs 2 more, 1 free
    assert pool.append_slots(table, 13) and table == [0, 1, 2, 3]
    pool.check_integrity([table])


def test_shared_prefix_is_found_and_referenced_twice():
    pool = make_pool()
    first = compute(pool, list(range(10)))  # 2 full blocks and 2 tokens
    h0 = hash_block(None, [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert first == [0, 1, 2]
    assert [pool.block_hash(b) for b in range(3)] == [h0, h1, None]
    assert pool.cached_block(h0) == 0 and pool.cached_block(h1) == 1
    second = compute(pool, [*range(8), 42])
    assert second == [0, 1, 3] and refs(pool)[:4] == [2, 2, 1, 1]
    pool.check_integrity([first, second])
    pool.free(first)
    pool.free(second)
    # Cached blocks stay as cached free blocks (LRU: the tail of the prefix first).
    assert state(pool) == (0, 2, 6) and list(pool.policy._evictable) == [1, 0]


def test_free_cached_blocks_are_reused_and_count_as_consumed():
    pool = make_pool(3)
    pool.free(compute(pool, list(range(9))))  # blocks 0, 1 cached; 2 empty
    assert state(pool) == (0, 2, 1)
    token_ids = np.arange(9, dtype=np.int32)
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, 4)
    hit = pool.find_cached_prefix(token_ids, hashes, 2)
    assert hit == [0, 1] and pool.num_blocks_to_take(hit, 1) == 3
    assert pool.allocate(hit, 2) is None  # 2 hits + 2 new > 3 free
    assert pool.allocate(hit, 1) == [0, 1, 2] and state(pool) == (3, 0, 0)
    assert pool.stats().num_evictions == 0


def test_a_hash_collision_never_returns_another_prefix():
    pool = make_pool()
    cached = compute(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    h0, h1 = pool.block_hash(0), pool.block_hash(1)
    # Same hashes, different tokens: the stored token ids refuse the hit.
    other = np.array([9, 9, 9, 9, 5, 6, 7, 8], dtype=np.int32)
    assert pool.find_cached_prefix(other, [h0, h1], 2) == []
    # Block 1's tokens again, forged onto another parent that is itself cached: the parent
    # check refuses it, since block 1's KV was computed after [1, 2, 3, 4].
    parent = compute(pool, [7, 7, 7, 7, 0])
    mixed = np.array([7, 7, 7, 7, 5, 6, 7, 8], dtype=np.int32)
    assert pool.find_cached_prefix(mixed, [pool.block_hash(parent[0]), h1], 2) == [parent[0]]
    # And a table whose block collides at registration stays out of the cache, with its tail.
    forged = compute(pool, [3, 3, 3, 3, 4, 4, 4, 4], hashes=[h0, hash_block(h0, [4, 4, 4, 4])])
    assert [pool.block_hash(b) for b in forged] == [None, None]
    pool.check_integrity([cached, parent, forged])


def test_identical_blocks_computed_twice_are_merged():
    pool = make_pool()
    tokens = np.arange(9, dtype=np.int32)
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, 4)
    first = pool.allocate([], 3)
    second = pool.allocate([], 3)  # admitted in the same step: no hit yet
    assert (first, second) == ([0, 1, 2], [3, 4, 5])
    pool.cache_blocks(first, tokens, hashes, 0, 2)
    pool.cache_blocks(second, tokens, hashes, 0, 2)
    assert second == [0, 1, 5] and refs(pool)[:6] == [2, 2, 1, 0, 0, 1]
    assert state(pool) == (4, 0, 4)
    pool.check_integrity([first, second])


def test_eviction_uses_empty_blocks_first_and_drops_the_hash():
    pool = make_pool(4)
    pool.free(compute(pool, list(range(8))))  # blocks 0, 1 cached free; 2, 3 empty
    h0 = pool.block_hash(0)
    table = pool.allocate([], 2)
    assert table == [2, 3] and pool.stats().num_evictions == 0
    assert pool.allocate([], 1) == [1]  # LRU: the tail block 1 was freed first
    assert pool.stats().num_evictions == 1 and pool.block_hash(1) is None
    assert pool.cached_block(h0) == 0
    pool.check_integrity([table, [1]])


def test_prefix_caching_off_never_hashes_or_hits():
    pool = make_pool(enable_prefix_caching=False)
    table = compute(pool, list(range(9)))
    assert [pool.block_hash(b) for b in table] == [None, None, None]
    pool.free(table)
    assert state(pool) == (0, 0, 8)
    assert compute(pool, list(range(9))) == [0, 1, 2]
    assert pool.stats().num_hit_tokens == 0


def test_stats_count_queries_and_hits():
    pool = make_pool()
    pool.record_query(10, 0)
    pool.record_query(10, 8)
    stats = pool.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens, stats.hit_rate) == (20, 8, 0.4)


def test_check_integrity_catches_broken_invariants():
    def broken(corrupt) -> None:
        pool = make_pool()
        table = compute(pool, list(range(10)))
        pool.check_integrity([table])
        tables = corrupt(pool, table)
        with pytest.raises(IntegrityError):
            pool.check_integrity(tables)

    broken(lambda pool, table: [table, [0]])  # a use the ref counts do not know
    broken(lambda pool, table: [table[:2]])  # a reference no table holds
    broken(lambda pool, table: (pool._empty.append(0), [table])[1])  # free and referenced
    broken(lambda pool, table: (pool._empty.append(7), [table])[1])  # twice in the empty list
    broken(lambda pool, table: (pool._hash_to_block.update({123: 2}), [table])[1])
    broken(lambda pool, table: (pool._hash_to_block.pop(pool.block_hash(0)), [table])[1])


def test_a_policy_instance_serves_one_pool():
    policy = LRUPolicy()
    BlockPool(4, 4, eviction_policy=policy)
    # Also while the first pool holds no evictable block: the two would share its records.
    with pytest.raises(ValueError, match="LRUPolicy instance already serves another pool"):
        BlockPool(4, 4, eviction_policy=policy)


class ChoosesAny(LRUPolicy):
    """An LRU policy whose victim is whatever block it is told to name."""

    choice: object = None

    def victim(self) -> object:
        return self.choice


@pytest.mark.parametrize("choice", ["in use", "empty", -1, 4, "2"])
def test_a_victim_that_is_not_evictable_is_refused_before_anything_changes(choice):
    policy = ChoosesAny()
    pool = BlockPool(4, 4, eviction_policy=policy)
    held = compute(pool, [0, 1, 2, 3, 0, 5, 6, 7])  # two cached blocks
    pool.free(held[:1])  # block held[0] is evictable, held[1] in use
    spare = pool.allocate([], 2)  # the empty blocks: the next block is evicted
    policy.choice = {"in use": held[1], "empty": None}.get(choice, choice)
    with pytest.raises(RuntimeError, match=r"ChoosesAny.victim\(\) chose .*not an evictable block"):
        pool.allocate([], 1)
    pool.check_integrity([held[1:], spare])
    policy.choice = held[0]
    assert pool.allocate([], 1) == [held[0]]


class Recorder(LRUPolicy):
    """LRU that keeps the blocks it heard were cached and not yet evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.known: set[int] = set()

    def on_cache(self, block_id: int) -> None:
        self.known.add(block_id)

    def on_evict(self, block_id: int) -> None:
        super().on_evict(block_id)
        self.known.discard(block_id)


def test_reset_tells_the_policy_of_every_cached_block_held_or_free():
    policy = Recorder()
    pool = make_pool(eviction_policy=policy)
    held = compute(pool, list(range(8)))  # two cached blocks, held
    pool.free(compute(pool, list(range(100, 108))))  # two cached blocks, free
    assert len(policy.known) == 4 and len(policy) == 2
    pool.reset()
    assert not policy.known and len(policy) == 0
    assert state(pool) == (0, 0, 8) and held == [0, 1]


def test_a_policy_that_raises_as_the_pool_resets_is_told_of_every_block_still():
    """One failed `on_evict` must not leave the policy holding blocks the pool forgot: they
    would come back as victims that are in use."""

    class FailsOnce(LRUPolicy):
        failed = False

        def on_evict(self, block_id):
            if not self.failed:
                self.failed = True
                raise KeyError(block_id)
            super().on_evict(block_id)

    policy = FailsOnce()
    pool = make_pool(4, eviction_policy=policy)
    for k in range(3):
        pool.free(compute(pool, [10 * k + i for i in range(4)]))
    with pytest.raises(KeyError):
        pool.reset()
    assert len(policy) == 0 and state(pool) == (0, 0, 4)
    tables = [compute(pool, [50 + 10 * k + i for i in range(4)]) for k in range(4)]
    pool.free(tables[0])
    assert pool.allocate([], 1) == tables[0]  # an eviction, of a free block
    pool.check_integrity(tables)
