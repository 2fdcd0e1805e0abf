"""Belady's offline eviction (MIN) as a baseline for the prefix-cache simulator.

With the whole workload known in advance, `BeladyPolicy` evicts the cached free block whose next
use lies furthest ahead (a block never used again first). A *use* of a block is a later request
that looks the block's hash up at admission: one of the first
`(num_prompt_tokens - 1) // block_size` chained block hashes of its prompt (`Scheduler._admit`).
A *refill* (a request computing and caching the block without looking it up: a block-aligned
prompt's last block, an output block) before the next use makes keeping the block worthless.
Ties, which between blocks used again only happen within one chain, go to the block cached
last, the deeper one: a block is always cached after its parent, and only reusable with its
whole prefix.

The pool's hooks name blocks by id only, so the policy also needs two facts no hook gives it:
each block's hash and how many requests have been admitted so far ("now").
`BeladyPolicy.bind` takes both as callables; `cache_sim.simulate` binds them (`bind_run`), so
`simulate(requests, config, BeladyPolicy.for_requests(requests, block_size))` is the whole
recipe (with arrival="time", the requests in arrival order).

An upper bound only with one request at a time (max_num_seqs=1): the pool is then a cache of
fixed size, and no online policy beats it (tests/research/test_belady.py). With several
requests running it is a heuristic: it does not see the re-admissions of preempted requests,
and a hit can cost hits, since a request that needs fewer fresh blocks lets the next one into
the same prefill step, where the two never hit each other's blocks.

Pure Python + numpy, no jax: O(log n) per pool event, after hashing every block once.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxllm.cache.eviction import PriorityPolicy
from jaxllm.cache.hashing import extend_block_hashes
from jaxllm.research.cache_sim import SYNTHETIC_TOKEN
from jaxllm.research.workloads import Request
from jaxllm.sched.sequence import Sequence as SchedSequence


def num_cached_blocks(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Full blocks a request run alone enters into the prefix cache: its prompt's, then those
    its output completes before the step that samples its last token is planned.

    The engine plans step N + 1 before it applies step N's token, so the token sampled second
    to last arrives after its sequence was released, and the block it completes is computed
    but never cached.
    """
    return (num_prompt_tokens + max(0, max_tokens - 2)) // block_size


def request_block_hashes(request: Request, block_size: int) -> tuple[list[int], int]:
    """The chained hashes of the blocks a request run alone caches, in order (its prompt, then
    the simulator's synthetic output), and how many of the first ones it looks up at its first
    admission: `(num_prompt_tokens - 1) // block_size`, as `Scheduler._admit` does."""
    prompt = request.prompt_token_ids
    num_cached = num_cached_blocks(len(prompt), request.max_tokens, block_size)
    num_output = max(0, num_cached * block_size - len(prompt))
    tokens = np.concatenate([prompt, np.full(num_output, SYNTHETIC_TOKEN, np.int32)])
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens[: num_cached * block_size], block_size)
    return hashes, (len(prompt) - 1) // block_size


@dataclass(frozen=True)
class BlockAccesses:
    """When the requests of a workload need each block, by position in the workload.

    Attributes:
        lookups: block hash -> positions of the requests that look it up at admission (a hit
            saves its computation), increasing.
        refills: block hash -> positions of the requests that compute and cache it without
            looking it up (a block-aligned prompt's last block, output blocks), increasing: a
            refill puts the block back in the cache for the lookups after it.
        num_requests: the workload's length.
        block_size: the tokens of a block.
        prompt_ends: each request's prompt length, first and last token, by position: to
            check that a run admits the requests in this order (`AdmissionCounter`).
    """

    lookups: dict[int, list[int]]
    refills: dict[int, list[int]]
    num_requests: int
    block_size: int
    prompt_ends: tuple[tuple[int, int, int], ...] = ()


def block_accesses(requests: Sequence[Request], block_size: int) -> BlockAccesses:
    """The lookups and refills of every block of `requests`, each run with its own max_tokens
    (`make_config`'s default max_model_len cuts no request short)."""
    lookups: dict[int, list[int]] = {}
    refills: dict[int, list[int]] = {}
    for position, request in enumerate(requests):
        hashes, num_lookups = request_block_hashes(request, block_size)
        for index, block_hash in enumerate(hashes):
            accesses = lookups if index < num_lookups else refills
            accesses.setdefault(block_hash, []).append(position)
    ends = tuple(_prompt_end(request.prompt_token_ids) for request in requests)
    return BlockAccesses(lookups, refills, len(requests), block_size, ends)


def _prompt_end(prompt: Sequence[int]) -> tuple[int, int, int]:
    return len(prompt), int(prompt[0]), int(prompt[-1])


class BeladyPolicy(PriorityPolicy):
    """Evicts the cached free block whose next use is furthest ahead; among equal next uses the
    block cached last (a child before its parent).

    A block's next use is the next request that looks it up, or never if a request refills it
    first (computes it without a lookup: the refill puts it back for free, so keeping it until
    then saves no computation). Its priority is read when it is freed, from the number of
    requests admitted then; it stays right while the block is evictable, since a request that
    looks up an evictable block (whose prefix is cached too: a parent's next use is never later
    than its child's) hits it.

    Mutates, besides `PriorityPolicy`'s heap: the order in which blocks were cached.

    Args:
        accesses: the workload's block lookups and refills (`block_accesses`), by position in
            the order the simulator first admits the requests (the list order for
            arrival="order"; sorted by arrival_time for "time").
    """

    name = "belady"

    def __init__(self, accesses: BlockAccesses) -> None:
        super().__init__()
        self._accesses = accesses
        self._cached_order: dict[int, int] = {}
        self._counter = itertools.count()
        self._block_hash: Callable[[int], int | None] | None = None
        self._num_admitted: Callable[[], int] | None = None

    @classmethod
    def for_requests(cls, requests: Sequence[Request], block_size: int) -> BeladyPolicy:
        """The policy for replaying `requests` (in admission order) with blocks of
        `block_size` tokens."""
        return cls(block_accesses(requests, block_size))

    def bind(
        self, block_hash: Callable[[int], int | None], num_admitted: Callable[[], int]
    ) -> None:
        """Connects the policy to one run (mutates the policy's sources).

        Args:
            block_hash: block id -> its prefix-cache hash (`BlockPool.block_hash`).
            num_admitted: how many requests have been admitted at least once so far; request
                positions below it are the past.
        """
        self._block_hash = block_hash
        self._num_admitted = num_admitted

    def bind_run(self, pool, seqs: list[SchedSequence]) -> None:
        """What `cache_sim.simulate` calls: binds the policy to its pool and to its sequences,
        in the order they are added (the requests' order, or their arrival order).

        Raises:
            ValueError: the pool's blocks are not of the size the accesses were counted in;
                later, from a step, a request admitted out of the accesses' order.
        """
        if pool.block_size != self._accesses.block_size:
            raise ValueError(
                f"BeladyPolicy counted blocks of {self._accesses.block_size} tokens; the pool's "
                f"hold {pool.block_size}"
            )
        self.bind(pool.block_hash, AdmissionCounter(seqs, self._accesses.prompt_ends))

    def next_use(self, block_hash: int, num_admitted: int) -> int:
        """The position of the first request at or after `num_admitted` that looks up
        `block_hash` with no refill before it; `num_requests` (never) when there is none."""
        never = self._accesses.num_requests
        lookup = _first_at_or_after(self._accesses.lookups.get(block_hash), num_admitted, never)
        refill = _first_at_or_after(self._accesses.refills.get(block_hash), num_admitted, never)
        return lookup if lookup <= refill else never

    def on_cache(self, block_id: int) -> None:
        self._cached_order[block_id] = next(self._counter)

    def on_evict(self, block_id: int) -> None:
        super().on_evict(block_id)
        del self._cached_order[block_id]

    def priority(self, block_id: int) -> tuple[int, int]:
        if self._block_hash is None or self._num_admitted is None:
            raise RuntimeError("BeladyPolicy needs bind() before use: run it in cache_sim.simulate")
        block_hash = self._block_hash(block_id)
        assert block_hash is not None, f"freed block {block_id} is not cached"
        next_use = self.next_use(block_hash, self._num_admitted())
        return -next_use, -self._cached_order[block_id]


def _first_at_or_after(positions: list[int] | None, start: int, default: int) -> int:
    """The first of the increasing `positions` that is at least `start`; `default` if none."""
    if positions is None:
        return default
    index = bisect.bisect_left(positions, start)
    return positions[index] if index < len(positions) else default


class AdmissionCounter:
    """Counts the requests of a run admitted at least once: the sequences, in the order they
    were added, are admitted first in that order, so the count is a cursor over them.

    Raises (when called):
        ValueError: an admitted sequence is not the request `expected` (its prompt's ends) at
            its position: the accesses were counted in another order.
    """

    def __init__(
        self, seqs: list[SchedSequence], expected: Sequence[tuple[int, int, int]] = ()
    ) -> None:
        self._seqs = seqs
        self._expected = expected
        self._count = 0

    def __call__(self) -> int:
        seqs, count = self._seqs, self._count
        while count < len(seqs) and seqs[count].num_cached_tokens is not None:
            seq, length = seqs[count], seqs[count].num_prompt_tokens
            end = (length, seq.token_at(0), seq.token_at(length - 1))
            if count < len(self._expected) and end != self._expected[count]:
                raise ValueError(
                    f"request {count} of the run is not request {count} of BeladyPolicy's "
                    "accesses: build it from the requests in the order the run admits them "
                    "(sorted by arrival_time for arrival='time')"
                )
            count += 1
        self._count = count
        return count
