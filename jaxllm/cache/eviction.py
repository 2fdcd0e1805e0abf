"""Eviction policies: which cached free block the pool gives up when it needs a block.

Every operation is O(1) (LRU, MRU) or amortised O(log n) (FIFO, LFU): pools hold 10^4-10^5
blocks. A new policy is usually a `PriorityPolicy` subclass with a `priority` method. A policy
may read what the pool knows of a block (`info`, a `BlockInfo`) and refuse to keep a freed block
(`admit`).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class BlockInfo:
    """What the pool knows of a cached block (`EvictionPolicy.info`).

    Attributes:
        metadata: `SamplingParams.extra_args` of the request that last held it ({} if none):
            in `on_cache` the one that filled it, in `on_hit` the one before the hit.
        time: the pool's clock now: wall seconds in the engine, simulated ones in the simulator.
        num_hits: prefix hits on it since it was cached.
        position: its index in its prefix: `position * block_size` tokens come before it.
        holder_blocks: the blocks of the request that last held it (a longer request costs
            more to compute again); in `on_cache`, those it holds so far.
    """

    metadata: Mapping[str, Any]
    time: float
    num_hits: int
    position: int
    holder_blocks: int


class EvictionPolicy(ABC):
    """Chooses the victim among the evictable (cached, unreferenced) blocks of one pool.

    Every method mutates the policy's own record of evictable blocks and their history: a
    subclass keeps it in `_evictable`, a dict keyed by those blocks, or overrides `__len__` and
    `__contains__`.
    """

    name: ClassVar[str] = ""
    _evictable: dict[int, Any]
    pool: Any = None  # the `BlockPool` that uses it, set by the pool

    def info(self, block_id: int) -> BlockInfo:
        """What the pool knows of cached block `block_id` now."""
        return self.pool.block_info(block_id)

    def admit(self, block_id: int) -> bool:
        """Whether cached block `block_id`, losing its last reference, stays in the prefix
        cache; False forgets it at once (an empty block), with no `on_evict`: a policy that
        keeps a block's history drops it here. Called before `on_free`."""
        return True

    def on_cache(self, block_id: int) -> None:  # noqa: B027 (an optional hook)
        """Block `block_id` got a hash; it is referenced, hence not evictable yet."""

    @abstractmethod
    def on_free(self, block_id: int) -> None:
        """Cached block `block_id` lost its last reference: it becomes evictable."""

    @abstractmethod
    def on_hit(self, block_id: int) -> None:
        """A prefix hit reused `block_id`; it stops being evictable if it was."""

    @abstractmethod
    def on_evict(self, block_id: int) -> None:
        """The pool evicted `block_id` (the last `victim()`, or any cached block when it
        resets): drop it and its history."""

    @abstractmethod
    def victim(self) -> int:
        """The evictable block to evict next (left in place: the pool calls `on_evict`)."""

    def __len__(self) -> int:
        """The number of evictable blocks."""
        return len(self._evictable)

    def __contains__(self, block_id: object) -> bool:
        """Whether `block_id` is evictable."""
        return block_id in self._evictable


class LRUPolicy(EvictionPolicy):
    """Least recently used: evicts the block that has been free the longest."""

    name = "lru"

    def __init__(self) -> None:
        # NOTE: not a dict: its first key is found past the slots its deleted keys leave, so
        # evicting the oldest would cost O(n) (34 vs 3.4 us a block at 10^5 blocks).
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest free first

    def on_free(self, block_id: int) -> None:
        self._evictable[block_id] = None

    def on_hit(self, block_id: int) -> None:
        self._evictable.pop(block_id, None)

    def on_evict(self, block_id: int) -> None:
        del self._evictable[block_id]

    def victim(self) -> int:
        return next(iter(self._evictable))


class MRUPolicy(LRUPolicy):
    """Most recently used: evicts the block freed last (suits one-pass scans over a long prompt)."""

    name = "mru"

    def victim(self) -> int:
        return next(reversed(self._evictable))


class PriorityPolicy(EvictionPolicy):
    """Evicts the evictable block of smallest `priority`, ties broken by least recently freed.

    A block's priority is read once, when it is freed, and must not change while it stays
    evictable. Kept in a heap with lazy deletion, rebuilt when stale entries dominate.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, int]] = []  # (priority, free order, block id)
        self._evictable: dict[int, tuple[Any, int, int]] = {}  # each one's live heap entry
        self._free_order = itertools.count()

    @abstractmethod
    def priority(self, block_id: int) -> Any:
        """A comparable key; smaller is evicted first."""

    def on_free(self, block_id: int) -> None:
        entry = (self.priority(block_id), next(self._free_order), block_id)
        self._evictable[block_id] = entry
        heapq.heappush(self._heap, entry)

    def on_hit(self, block_id: int) -> None:
        if self._evictable.pop(block_id, None) is not None:
            self._compact_if_stale()

    def on_evict(self, block_id: int) -> None:
        del self._evictable[block_id]
        self._compact_if_stale()

    def victim(self) -> int:
        heap = self._heap
        while self._evictable.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        return heap[0][2]

    def _compact_if_stale(self) -> None:
        if len(self._heap) > 2 * len(self._evictable) + 64:
            self._heap = list(self._evictable.values())
            heapq.heapify(self._heap)


class FIFOPolicy(PriorityPolicy):
    """First in, first out: evicts the block cached earliest, however often it was reused."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._cached_order: dict[int, int] = {}
        self._counter = itertools.count()

    def on_cache(self, block_id: int) -> None:
        self._cached_order[block_id] = next(self._counter)

    def on_evict(self, block_id: int) -> None:
        super().on_evict(block_id)
        del self._cached_order[block_id]

    def priority(self, block_id: int) -> int:
        return self._cached_order[block_id]


class LFUPolicy(PriorityPolicy):
    """Least frequently used: evicts the block with the fewest prefix hits since it was cached."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._hits: dict[int, int] = {}

    def on_cache(self, block_id: int) -> None:
        self._hits[block_id] = 0

    def on_hit(self, block_id: int) -> None:
        super().on_hit(block_id)
        self._hits[block_id] += 1

    def on_evict(self, block_id: int) -> None:
        super().on_evict(block_id)
        del self._hits[block_id]

    def priority(self, block_id: int) -> int:
        return self._hits[block_id]


POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy for policy in (LRUPolicy, FIFOPolicy, LFUPolicy, MRUPolicy)
}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A fresh policy from its name ("lru", "fifo", "lfu", "mru"), or `policy` itself."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return POLICIES[policy.lower()]()
    raise ValueError(
        f"eviction_policy must be one of {sorted(POLICIES)} or an EvictionPolicy instance, "
        f"got {policy!r}"
    )
