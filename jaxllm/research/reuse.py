"""Reuse distances of a workload's KV blocks, and from them the LRU hit rate at every cache size
in one pass (Mattson's stack algorithm).

The blocks are used in the order the simulator's LRU sees them with the requests run one at a
time in list order: a request looks up the first `(num_prompt_tokens - 1) // block_size` blocks
of its prompt, then, when it ends, frees every block it cached last to first (so its first
block is the most recently used). A lookup's reuse distance is the number of distinct other
blocks freed since the block's own last free, before the request started; a block never cached
before has none (a cold lookup). Under LRU a parent block is always more recent than its
children, so a cache of C entries hits exactly the lookups at distance < C, and a request's hits
are a prefix of its blocks, as the pool requires. `lru_entries` says when the simulator's LRU
is such a cache, and of how many entries.

Pure Python + numpy, no jax: O(log n) per block, after hashing every block once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxllm.research.belady import num_cached_blocks, request_block_hashes
from jaxllm.research.workloads import Request
from jaxllm.sched import SchedulerConfig


@dataclass(frozen=True)
class ReuseProfile:
    """The reuse distances of a workload's block lookups.

    Attributes:
        block_size: tokens per block.
        histogram: [D] histogram[d] is the number of lookups at reuse distance d.
        num_cold_lookups: lookups of a block never cached before (an infinite distance).
        num_queried_tokens: the prompt tokens of every request: the hit rate's denominator,
            as in `CacheStats.num_queried_tokens` when no request is preempted.
    """

    block_size: int
    histogram: np.ndarray
    num_cold_lookups: int
    num_queried_tokens: int

    @property
    def num_lookups(self) -> int:
        """Every block lookup, cold ones included."""
        return int(self.histogram.sum()) + self.num_cold_lookups

    def hit_blocks(self, num_entries: int) -> int:
        """Lookups that hit in an LRU cache of `num_entries` cached blocks."""
        return int(self.histogram[: max(0, num_entries)].sum())

    def hit_rate(self, num_entries: int) -> float:
        """Hit tokens over queried tokens with an LRU cache of `num_entries` cached blocks."""
        if not self.num_queried_tokens:
            return 0.0
        return self.hit_blocks(num_entries) * self.block_size / self.num_queried_tokens

    def hit_rate_curve(self, max_entries: int) -> np.ndarray:
        """[max_entries + 1] float64: the LRU hit rate with 0, 1, ..., max_entries entries."""
        counts = np.zeros(max_entries + 1, dtype=np.int64)
        head = self.histogram[:max_entries]
        counts[1 : len(head) + 1] = np.cumsum(head)
        counts[len(head) + 1 :] = counts[len(head)]
        return counts * self.block_size / max(1, self.num_queried_tokens)


def reuse_profile(requests: Sequence[Request], block_size: int) -> ReuseProfile:
    """The reuse distance of every block lookup of `requests`, run one at a time in list order.

    A request caches its prompt's full blocks and the output blocks it completes with its own
    max_tokens (`belady.num_cached_blocks`, the simulator's synthetic output tokens).
    """
    hashed = [request_block_hashes(request, block_size) for request in requests]
    tree = _FenwickTree(sum(len(hashes) for hashes, _ in hashed))
    last_free: dict[int, int] = {}  # block hash -> the time of its last free, from 1
    distances: list[int] = []
    num_cold = 0
    now = 0
    for hashes, num_lookups in hashed:
        num_distinct = len(last_free)
        for block_hash in hashes[:num_lookups]:
            freed = last_free.get(block_hash)
            if freed is None:
                num_cold += 1
            else:
                distances.append(num_distinct - tree.prefix_sum(freed))
        for block_hash in reversed(hashes):
            freed = last_free.get(block_hash)
            if freed is not None:
                tree.add(freed, -1)
            now += 1
            tree.add(now, 1)
            last_free[block_hash] = now
    return ReuseProfile(
        block_size=block_size,
        histogram=np.bincount(np.asarray(distances, dtype=np.int64), minlength=1),
        num_cold_lookups=num_cold,
        num_queried_tokens=sum(request.num_prompt_tokens for request in requests),
    )


def lru_entries(requests: Sequence[Request], config: SchedulerConfig) -> int | None:
    """The number of cached blocks that LRU holds at every lookup when `simulate(requests,
    config, "lru")` (arrival="order") is exactly predicted by `reuse_profile`: its hit tokens
    are then `profile.hit_blocks(entries) * block_size`; None when these sufficient
    conditions do not all hold:

    - one request at a time (max_num_seqs=1, one decode step per plan), so none is preempted,
      none misses the blocks of another prefilled in the same step, and at each lookup every
      block is free: cached, or empty;
    - prefix caching on;
    - no request's max_tokens cut by max_model_len (the profile caches a request's output
      blocks by its own max_tokens);
    - every request leaves the same number p of uncached blocks (0 or 1: the partial last
      block, or the full one its second-to-last token completes, `num_cached_blocks`), so once
      the pool is full a lookup always finds `num_blocks - p` cached blocks; p is 0 only for a
      block-aligned prompt with max_tokens=1;
    - every block a request caches without looking it up (a block-aligned prompt's last block,
      an output block) is new: a cached copy would take it over and leave one more empty block.

    Outside them the profile is a model, not a prediction. With several requests running,
    their blocks take room from the cache and prompts prefilled in one step miss each other's
    blocks: with 4 running requests on a Zipf prefix workload, the simulator's LRU hit rate is
    0.01 to 0.16 below `hit_rate(num_blocks - 1)` (tests/research/test_reuse.py).
    """
    size = config.block_size
    if not (
        config.enable_prefix_caching
        and config.max_num_seqs == 1
        and config.num_scheduler_steps == 1
    ):
        return None
    uncached: set[int] = set()
    cached: set[int] = set()
    for request in requests:
        num_prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
        if num_prompt + max_tokens > config.max_model_len:
            return None
        num_table = -(-(num_prompt + max_tokens - 1) // size)
        uncached.add(num_table - num_cached_blocks(num_prompt, max_tokens, size))
        hashes, num_lookups = request_block_hashes(request, size)
        if any(block_hash in cached for block_hash in hashes[num_lookups:]):
            return None
        cached.update(hashes)
    if len(uncached) > 1:
        return None
    return config.num_blocks - uncached.pop() if uncached else config.num_blocks


class _FenwickTree:
    """Counts over positions 1 .. size with O(log size) updates and prefix sums."""

    def __init__(self, size: int) -> None:
        self._counts = [0] * (size + 1)

    def add(self, position: int, delta: int) -> None:
        counts = self._counts
        while position < len(counts):
            counts[position] += delta
            position += position & -position

    def prefix_sum(self, position: int) -> int:
        """The sum of the counts at positions 1 .. position."""
        counts, total = self._counts, 0
        while position > 0:
            total += counts[position]
            position -= position & -position
        return total
