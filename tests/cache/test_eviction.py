"""Eviction policies: exact orders through the pool, and each policy against a brute-force
reference over random event sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.blocks import compute

from jaxllm.cache import (
    BlockPool,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    PriorityPolicy,
    make_policy,
)


def four_cached_blocks(policy) -> BlockPool:
    """Blocks a=0, b=1, c=2, d=3, cached in that order, each holding a 4-token prompt.

    Freed c, a, d, b; then a hit once, d twice, c once (each freed again right away). So the
    free order is b, a, d, c and the hit counts are a 1, b 0, c 1, d 2.
    """
    pool = BlockPool(4, 4, eviction_policy=policy)
    tables = [compute(pool, [10 * k + i for i in range(4)]) for k in range(4)]
    assert tables == [[0], [1], [2], [3]]
    for block_id in (2, 0, 3, 1):
        pool.free([block_id])
    for block_id in (0, 3, 3, 2):
        assert pool.allocate([block_id], 0) == [block_id]
        pool.free([block_id])
    pool.check_integrity([])
    return pool


@pytest.mark.parametrize(
    ("policy", "order"),
    [("lru", [1, 0, 3, 2]), ("mru", [2, 3, 0, 1]), ("fifo", [0, 1, 2, 3]), ("lfu", [1, 0, 2, 3])],
)
def test_eviction_order(policy, order):
    pool = four_cached_blocks(policy)
    hashes = [pool.block_hash(b) for b in range(4)]
    evicted = []
    for count in range(1, 5):
        evicted += pool.allocate([], 1)
        assert pool.stats().num_evictions == count
        assert pool.cached_block(hashes[evicted[-1]]) is None
        pool.check_integrity([[b] for b in evicted])
    assert evicted == order


class HighestIdFirst(PriorityPolicy):
    """A new policy is a short class: evict the highest block id first."""

    def priority(self, block_id: int) -> int:
        return -block_id


def test_a_custom_policy_plugs_in():
    pool = four_cached_blocks(HighestIdFirst())
    assert [pool.allocate([], 1)[0] for _ in range(4)] == [3, 2, 1, 0]


@pytest.mark.parametrize("hook", ["on_free", "on_hit", "on_evict"])
def test_a_policy_that_breaks_a_hooks_contract_is_named(hook):
    """A freed cached block the policy does not hold (or a hit or evicted one it keeps) would
    leak or be handed out twice: the pool names the hook at once."""

    class Broken(LRUPolicy):
        def on_free(self, block_id):
            if hook != "on_free":
                super().on_free(block_id)

        def on_hit(self, block_id):
            if hook != "on_hit":
                super().on_hit(block_id)

        def on_evict(self, block_id):
            if hook != "on_evict":
                super().on_evict(block_id)

    with pytest.raises(RuntimeError, match=rf"Broken\.{hook}\(\d\) left block \d"):
        four_cached_blocks(Broken()).allocate([], 1)


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("FIFO"), FIFOPolicy)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    assert isinstance(make_policy("mru"), MRUPolicy)
    assert make_policy("lru") is not make_policy("lru")
    mine = HighestIdFirst()
    assert make_policy(mine) is mine
    with pytest.raises(ValueError, match="'lru'"):
        make_policy("random")


class Reference:
    """What each policy must answer, computed by scanning every evictable block."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.clock = 0
        self.cached_at: dict[int, int] = {}
        self.freed_at: dict[int, int] = {}  # the evictable blocks
        self.hits: dict[int, int] = {}

    def victim(self) -> int:
        key = {
            "lru": lambda b: self.freed_at[b],
            "mru": lambda b: -self.freed_at[b],
            "fifo": lambda b: self.cached_at[b],
            "lfu": lambda b: (self.hits[b], self.freed_at[b]),
        }[self.name]
        return min(self.freed_at, key=key)


events = st.lists(
    st.tuples(st.sampled_from(["cache", "free", "hit", "evict"]), st.integers(0, 11)), min_size=40
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["lru", "mru", "fifo", "lfu"]), events)
def test_policies_match_a_brute_force_reference(name, ops):
    policy: EvictionPolicy = make_policy(name)
    ref = Reference(name)
    in_use: set[int] = set()
    for op, block_id in ops * 8:  # repeated, so the lazy heaps need compacting
        ref.clock += 1
        cached = block_id in ref.cached_at
        if op == "cache" and not cached:
            policy.on_cache(block_id)
            ref.cached_at[block_id], ref.hits[block_id] = ref.clock, 0
            in_use.add(block_id)
        elif op == "free" and block_id in in_use:
            policy.on_free(block_id)
            in_use.remove(block_id)
            ref.freed_at[block_id] = ref.clock
        elif op == "hit" and cached:
            policy.on_hit(block_id)
            ref.hits[block_id] += 1
            ref.freed_at.pop(block_id, None)
            in_use.add(block_id)
        elif op == "evict" and ref.freed_at:
            victim = policy.victim()
            assert victim == ref.victim()
            policy.on_evict(victim)
            del ref.freed_at[victim], ref.cached_at[victim], ref.hits[victim]
        assert len(policy) == len(ref.freed_at)
        assert all(b in policy for b in ref.freed_at)


@pytest.mark.parametrize("name", ["fifo", "lfu"])
def test_priority_heaps_stay_bounded(name):
    policy = make_policy(name)
    for block_id in range(4):
        policy.on_cache(block_id)
    for _ in range(1000):  # free and reuse the same blocks: every reuse leaves a stale entry
        for block_id in range(4):
            policy.on_free(block_id)
        for block_id in range(4):
            policy.on_hit(block_id)
    assert len(policy) == 0 and len(policy._heap) <= 65
    for block_id in (2, 0, 3):
        policy.on_free(block_id)
    # FIFO: cached first; LFU: equal hit counts, so freed first.
    assert policy.victim() == (0 if name == "fifo" else 2)
