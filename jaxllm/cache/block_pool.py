"""The block pool: a fixed set of KV blocks with ref counts, a prefix cache and eviction.

Every block is exactly one of *used* (ref count > 0, cached or not), *cached free* (unreferenced,
still holding a prefix-cache entry: evictable, so in the eviction policy) or *empty*
(unreferenced, no entry). Freed blocks keep their contents and hash until evicted; new blocks
come from the empty ones first, from eviction only when none is left.

A cached block records its token ids, a unique key and its parent's key. A prefix hit accepts a
block only if its tokens equal the request's and its parent is the block accepted just before,
so by induction every accepted block holds the KV of exactly the request's prefix, hash
collisions notwithstanding.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxllm.cache.eviction import BlockInfo, EvictionPolicy, make_policy
from jaxllm.cache.hashing import pack_token_ids

ROOT_KEY = 0  # the parent key of a sequence's first block; block keys start at 1
NO_METADATA: Mapping = types.MappingProxyType({})


class IntegrityError(AssertionError):
    """An invariant of the pool (or of the scheduler on top of it) is broken."""


def require(condition: bool, message: str) -> None:
    """Raises `IntegrityError(message)` unless `condition` holds."""
    if not condition:
        raise IntegrityError(message)


@dataclass(frozen=True)
class CacheStats:
    """Prefix-cache counters since the pool was built, and the pool's state now.

    Attributes:
        num_queried_tokens: tokens looked up in the prefix cache when requests were admitted
            (a request resumed after preemption is looked up again).
        num_hit_tokens: of those, tokens whose KV came from the cache.
        num_evictions: cached blocks whose entry was dropped to make room.
        num_used_blocks, num_cached_free_blocks, num_empty_blocks: the blocks in each state.
    """

    num_queried_tokens: int
    num_hit_tokens: int
    num_evictions: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_empty_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class BlockPool:
    """Owns `num_blocks` KV blocks: ref counts, the empty list, the hash map, the policy.

    Block tables are plain lists of block ids, owned by the caller (the scheduler). `clock`
    gives the time policies see (`block_info`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str | EvictionPolicy = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = make_policy(eviction_policy)
        if self.policy.pool is not None:
            raise ValueError(
                f"this {type(self.policy).__name__} instance already serves another pool (an LLM "
                "or a simulation): give each its own instance, or the policy's name"
            )
        self.policy.pool = self
        self.clock = clock
        self._keys, self._parent_keys = [0] * num_blocks, [0] * num_blocks
        # What policies see of a cached block (`block_info`).
        self._metadata: list[Mapping] = [NO_METADATA] * num_blocks
        self._num_hits, self._positions = [0] * num_blocks, [0] * num_blocks
        self._holder_blocks = [0] * num_blocks
        self._clear()
        self._new_keys = itertools.count(ROOT_KEY + 1)
        self._num_queried_tokens = self._num_hit_tokens = self._num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get now: empty ones plus evictable cached ones."""
        return len(self._empty) + len(self.policy)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The block's prefix-cache hash, or None when it holds no entry."""
        return self._hashes[block_id]

    def cached_block(self, block_hash: int) -> int | None:
        """The block holding the entry for `block_hash`, if any (no token check)."""
        return self._hash_to_block.get(block_hash)

    def find_cached_prefix(
        self, token_ids: np.ndarray | Sequence[int], block_hashes: Sequence[int], max_blocks: int
    ) -> list[int]:
        """The ids of the longest run of cached blocks holding the KV of the first blocks (at
        most `max_blocks`) of `token_ids`, whose chained hashes are `block_hashes`. Mutates
        nothing, not even the statistics (`record_query` counts)."""
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        hit: list[int] = []
        parent_key = ROOT_KEY
        for index in range(min(max_blocks, len(block_hashes))):
            block_id = self._hash_to_block.get(block_hashes[index])
            if block_id is None or self._parent_keys[block_id] != parent_key:
                break
            start = index * size
            if self._tokens[block_id] != pack_token_ids(token_ids[start : start + size]):
                break
            hit.append(block_id)
            parent_key = self._keys[block_id]
        return hit

    def num_blocks_to_take(self, cached_block_ids: Sequence[int], num_new_blocks: int) -> int:
        """Free blocks that `allocate(cached_block_ids, num_new_blocks)` would consume."""
        refs = self._ref_counts
        return num_new_blocks + sum(1 for block_id in cached_block_ids if refs[block_id] == 0)

    def allocate(self, cached_block_ids: Sequence[int], num_new_blocks: int) -> list[int] | None:
        """References the hit blocks and `num_new_blocks` fresh ones: a new block table
        (`cached_block_ids`, then the fresh blocks), or None if they do not fit.

        Mutates ref counts, the empty list, the policy (hits, and evictions when the empty list
        runs out) and the hash map (evicted entries); nothing when it returns None.
        """
        if self.num_blocks_to_take(cached_block_ids, num_new_blocks) > self.num_free_blocks:
            return None
        for block_id in cached_block_ids:
            self._reference(block_id)
        return [*cached_block_ids, *self._take_fresh(num_new_blocks)]

    def append_slots(self, block_table: list[int], num_tokens: int) -> bool:
        """Grows `block_table` in place to hold `num_tokens` tokens; False (no change) if full."""
        if num_tokens <= len(block_table) * self.block_size:
            return True  # NOTE: most decode steps: the last block has room
        num_new_blocks = -(-num_tokens // self.block_size) - len(block_table)
        if num_new_blocks > self.num_free_blocks:
            return False
        block_table.extend(self._take_fresh(num_new_blocks))
        return True

    def free(self, block_table: Iterable[int], metadata: Mapping | None = None) -> None:
        """Drops one reference to each block; unreferenced cached ones go to the policy, unless
        it does not admit them (then they are forgotten, empty). `metadata`: the holder's
        (`BlockInfo.metadata`).

        Blocks are released last to first, so that under LRU a prefix's tail is evicted first.
        """
        refs = self._ref_counts
        metadata = NO_METADATA if metadata is None else metadata
        block_table = list(block_table)
        for block_id in reversed(block_table):
            refs[block_id] -= 1
            self._metadata[block_id] = metadata
            self._holder_blocks[block_id] = len(block_table)
            if refs[block_id] == 0:
                if self._hashes[block_id] is not None and self._admits(block_id):
                    self.policy.on_free(block_id)
                    self._check_policy("on_free", block_id, evictable=True)
                    continue
                if self._hashes[block_id] is not None:
                    self._forget(block_id)
                self._empty.append(block_id)

    def block_info(self, block_id: int) -> BlockInfo:
        """What the pool knows of a cached block, for its policy."""
        return BlockInfo(
            self._metadata[block_id],
            self.clock(),
            self._num_hits[block_id],
            self._positions[block_id],
            self._holder_blocks[block_id],
        )

    def cache_blocks(
        self,
        block_table: list[int],
        token_ids: np.ndarray | Sequence[int],
        block_hashes: Sequence[int],
        first: int,
        last: int,
        metadata: Mapping | None = None,
    ) -> None:
        """Enters the full, computed blocks `first` .. `last - 1` of a table (referenced by it
        alone) into the cache. Where an identical block is already cached (one prefix computed
        twice in a step) the table switches to it in place and its own copy returns to the empty
        list; after a collision (another block owns the hash) the rest stays uncached.
        `metadata`: the holder's (`BlockInfo.metadata`), as `on_cache` sees it."""
        if not self.enable_prefix_caching or first >= last:
            return
        if first == 0:
            parent_key = ROOT_KEY
        elif self._hashes[block_table[first - 1]] is not None:
            parent_key = self._keys[block_table[first - 1]]
        else:
            return  # the parent is not cached, so no lookup could ever reach these blocks
        size = self.block_size
        for index in range(first, last):
            block_id = block_table[index]
            block_hash = block_hashes[index]
            tokens = pack_token_ids(token_ids[index * size : (index + 1) * size])
            owner = self._hash_to_block.get(block_hash)
            if owner is None:
                self._hashes[block_id] = block_hash
                self._keys[block_id] = next(self._new_keys)
                self._parent_keys[block_id] = parent_key
                self._tokens[block_id] = tokens
                self._hash_to_block[block_hash] = block_id
                self._num_hits[block_id], self._positions[block_id] = 0, index
                self._metadata[block_id] = NO_METADATA if metadata is None else metadata
                self._holder_blocks[block_id] = len(block_table)
                self.policy.on_cache(block_id)
            elif owner != block_id:
                if self._tokens[owner] != tokens or self._parent_keys[owner] != parent_key:
                    return  # a hash collision
                self._reference(owner)
                block_table[index] = owner
                self.free((block_id,))
                block_id = owner
            parent_key = self._keys[block_id]

    def reset(self) -> None:
        """Makes every block empty and forgets every cached prefix, whatever the ref counts said
        (`Scheduler.reset`: no sequence holds a block, or none can be trusted to). The policy is
        told of each cached block's eviction (a held one freed first); where a hook raises, it
        is told of the others and evicts what it kept once more, then the first error is raised."""
        errors = []
        try:
            for block_id in (b for b in range(self.num_blocks) if self._hashes[b] is not None):
                try:
                    if block_id not in self.policy:
                        self.policy.on_free(block_id)
                    self.policy.on_evict(block_id)
                except Exception as error:  # NOTE: a researcher's policy: any
                    errors.append(error)
            for block_id in (b for b in range(self.num_blocks) if errors and b in self.policy):
                with contextlib.suppress(Exception):
                    self.policy.on_evict(block_id)
        finally:
            self._clear()
        if errors:
            raise errors[0]

    def _clear(self) -> None:
        """Every block empty: no reference, no entry."""
        n = self.num_blocks
        self._ref_counts, self._hashes, self._tokens = [0] * n, [None] * n, [None] * n
        self._hash_to_block: dict[int, int] = {}
        self._empty = list(range(n - 1, -1, -1))  # a stack: block 0 is handed out first

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admission: `num_tokens` looked up, `num_hit_tokens` served from the cache."""
        self._num_queried_tokens += num_tokens
        self._num_hit_tokens += num_hit_tokens

    def stats(self) -> CacheStats:
        return CacheStats(
            num_queried_tokens=self._num_queried_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_evictions=self._num_evictions,
            num_used_blocks=self.num_blocks - self.num_free_blocks,
            num_cached_free_blocks=len(self.policy),
            num_empty_blocks=len(self._empty),
        )

    def _take_fresh(self, count: int) -> list[int]:
        """`count` unreferenced blocks with no entry: empty ones first, then evicted ones."""
        taken = []
        for _ in range(count):
            if self._empty:
                block_id = self._empty.pop()
            else:
                block_id = self.policy.victim()
                if not (  # a cached block no sequence holds
                    isinstance(block_id, int | np.integer)
                    and 0 <= block_id < self.num_blocks
                    and self._ref_counts[block_id] == 0
                    and self._hashes[block_id] is not None
                ):
                    raise RuntimeError(
                        f"{type(self.policy).__name__}.victim() chose {block_id!r}, which is not "
                        "an evictable block (cached, unreferenced) of its pool"
                    )
                self.policy.on_evict(block_id)
                self._check_policy("on_evict", block_id, evictable=False)
                self._forget(block_id)
                self._num_evictions += 1
            self._ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def _admits(self, block_id: int) -> bool:
        """The policy's `admit`, which must say True or False (None is no answer)."""
        if isinstance(admitted := self.policy.admit(block_id), bool | np.bool_):
            return bool(admitted)
        name = type(self.policy).__name__
        raise RuntimeError(f"{name}.admit({block_id}) returned {admitted!r}, not a bool")

    def _reference(self, block_id: int) -> None:
        """One more reference to a cached block, a prefix hit (no longer evictable)."""
        self._ref_counts[block_id] += 1
        self._num_hits[block_id] += 1
        self.policy.on_hit(block_id)
        self._check_policy("on_hit", block_id, evictable=False)

    def _check_policy(self, hook: str, block_id: int, evictable: bool) -> None:
        """Raises RuntimeError unless the policy's `hook` left `block_id` in it iff `evictable`."""
        if (block_id in self.policy) != evictable:
            raise RuntimeError(
                f"{type(self.policy).__name__}.{hook}({block_id}) left block {block_id} "
                f"{'out of' if evictable else 'among'} its evictable blocks (`in`): a policy "
                "holds each cached free block from on_free until on_hit or on_evict"
            )

    def _forget(self, block_id: int) -> None:
        """Drops the prefix-cache entry of a block (evicted, or not admitted)."""
        del self._hash_to_block[self._hashes[block_id]]
        self._hashes[block_id] = None
        self._tokens[block_id] = None

    def check_integrity(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raises `IntegrityError` unless every invariant of the pool holds, given the block
        tables of every live sequence.

        Checks: ref counts equal the uses in `block_tables`; every block is in exactly one state
        (see the module docstring); the hash map and the blocks' hashes agree; keys are unique.
        """
        uses = Counter(block_id for table in block_tables for block_id in table)
        require(
            all(0 <= block_id < self.num_blocks for block_id in uses),
            f"block id out of range in {sorted(uses)}",
        )
        empty = set(self._empty)
        require(len(empty) == len(self._empty), "a block is twice in the empty list")
        for block_id in range(self.num_blocks):
            refs = self._ref_counts[block_id]
            cached = self._hashes[block_id] is not None
            require(
                refs == uses[block_id],
                f"block {block_id}: ref count {refs} but {uses[block_id]} uses in live tables",
            )
            free_states = (block_id in empty) + (block_id in self.policy)
            require(
                free_states == (refs == 0),
                f"block {block_id}: ref count {refs}, empty={block_id in empty}, "
                f"evictable={block_id in self.policy}",
            )
            require(not (cached and block_id in empty), f"empty block {block_id} has a hash")
            require(cached or block_id not in self.policy, f"evictable block {block_id} no hash")
        num_used = sum(1 for count in self._ref_counts if count > 0)
        require(len(empty) + len(self.policy) + num_used == self.num_blocks, "free + used != total")
        hashed = [b for b in range(self.num_blocks) if self._hashes[b] is not None]
        require(len(hashed) == len(self._hash_to_block), "hashed blocks missing from the map")
        for block_hash, block_id in self._hash_to_block.items():
            require(
                self._hashes[block_id] == block_hash,
                f"hash map entry {block_hash:#x} -> block {block_id} with hash "
                f"{self._hashes[block_id]}",
            )
        keys = [self._keys[b] for b in hashed]
        require(len(set(keys)) == len(keys), "two cached blocks share a key")
        require(self.enable_prefix_caching or not hashed, "hashes with prefix caching off")
