"""Belady's offline policy: hand-counted traces, its rules (next use, refills, children first),
never beaten by an online policy when requests run one at a time, and the known case where
running several at once beats it (pure Python + numpy, no model)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.repo import assert_import_leaves_out

from jaxllm.research import workloads as w
from jaxllm.research.belady import (
    BeladyPolicy,
    block_accesses,
    num_cached_blocks,
)
from jaxllm.research.cache_sim import POLICY_NAMES, make_config, simulate
from jaxllm.research.workloads import Request

BLOCK = 4


def one_block_requests(names: str) -> list[Request]:
    """One request per letter: the letter's own block of 4 tokens plus one token of its own,
    max_tokens=1; so a request looks up one block, caches it, and frees one partial block."""
    return [
        Request(np.array([*range(100 * ord(name), 100 * ord(name) + 4), 10_000 + k], np.int32), 1)
        for k, name in enumerate(names)
    ]


def sequential_config(requests, num_blocks):
    """One request at a time: a pool of N blocks holds N - 1 cached one-block entries at each
    lookup (the last one is the running request's partial block)."""
    return make_config(
        requests,
        num_blocks,
        block_size=BLOCK,
        max_num_seqs=1,
        max_num_batched_tokens=16,
        prefill_tile=4,
    )


def hit_blocks(requests, config, policy) -> int:
    if policy == "belady":
        policy = BeladyPolicy.for_requests(requests, config.block_size)
    result = simulate(requests, config, policy, check_integrity=True)
    assert result.num_preemptions == 0
    return result.num_hit_tokens // BLOCK


def test_textbook_reference_string():
    """Silberschatz's reference string with 3 frames: OPT 9 faults, LRU 12, FIFO 15 of 20.

    OPT, frames after each miss (evicting the page used furthest ahead):
    7 [7]; 0 [7 0]; 1 [7 0 1]; 2 [2 0 1] (7 next at 18); 0 hit; 3 [2 0 3] (1 next at 14);
    0 hit; 4 [2 4 3] (0 next at 11); 2 hit; 3 hit; 0 [2 0 3] (4 never again); 3 hit; 2 hit;
    1 [2 0 1] (3 never again); 2, 0, 1 hit; 7 [7 0 1] (2 never again); 0, 1 hit: 11 hits.
    """
    pages = "H A B C A D A E C D A D C B C A B H A B"  # 7 0 1 2 0 3 0 4 2 3 0 3 2 1 2 0 1 7 0 1
    requests = one_block_requests(pages.replace(" ", ""))
    config = sequential_config(requests, 3 + 1)
    assert hit_blocks(requests, config, "belady") == 20 - 9
    assert hit_blocks(requests, config, "lru") == 20 - 12
    assert hit_blocks(requests, config, "fifo") == 20 - 15
    for policy in ("lfu", "mru"):
        assert hit_blocks(requests, config, policy) < 20 - 9


def test_belady_matches_lfu_on_hot_prefix_with_scans():
    # hot_prefix_with_scans(8, 24, 8) with 8 entries: one-off blocks are never looked up
    # again, and the hot block's first use must miss, so 96 - 1 hits is the most any policy
    # gets; LFU gets it (docs/cache-policies.md), and so does Belady.
    requests = w.hot_prefix_with_scans(8, 24, 8, seed=0)
    config = make_config(
        requests, 8 + 1, block_size=16, max_num_seqs=1, max_num_batched_tokens=32, prefill_tile=16
    )
    belady = simulate(requests, config, BeladyPolicy.for_requests(requests, 16))
    lfu = simulate(requests, config, "lfu")
    assert belady.num_hit_tokens // 16 == lfu.num_hit_tokens // 16 == 8 * 24 // 2 - 1
    assert belady.policy == "belady"


def test_a_child_goes_before_its_parent():
    # Blocks of 4 tokens, one request at a time, 3 blocks. R0 = [A B x] caches A and B (its
    # partial block goes back empty); R1 = [D x] needs 2 blocks: the empty one and one of A, B.
    # Both are next used by R2 = [A B y]: the child B goes, so R2 still hits A (1 block);
    # evicting A leaves B unreachable and R2 hits nothing (FIFO, which evicts the block cached
    # first, and MRU, which evicts the block freed last: a table is freed tail first).
    a_b = list(range(100, 108))
    requests = [
        Request(np.array([*a_b, 1], np.int32), 1),
        Request(np.array([*range(200, 204), 2], np.int32), 1),
        Request(np.array([*a_b, 3], np.int32), 1),
    ]
    config = sequential_config(requests, 3)
    assert hit_blocks(requests, config, "belady") == 1
    assert hit_blocks(requests, config, "fifo") == hit_blocks(requests, config, "mru") == 0


def test_equal_next_uses_evict_the_block_cached_last():
    """Between blocks with the same next use, the one cached later (a child, in a pool) goes
    first, whatever the order they were freed in."""
    requests = [Request(np.arange(1, 10, dtype=np.int32), 1)] * 2
    accesses = block_accesses(requests, BLOCK)
    parent, child = (h for h, positions in accesses.lookups.items() if positions == [0, 1])
    policy = BeladyPolicy(accesses)
    hashes = {0: parent, 1: child, 2: 12345}
    policy.bind(hashes.__getitem__, lambda: 1)
    for block_id in (0, 1, 2):
        policy.on_cache(block_id)
    for block_id in (0, 1, 2):  # the parent freed first: the free order alone would evict it
        policy.on_free(block_id)
    assert policy.victim() == 2  # never used again
    policy.on_evict(2)
    assert policy.victim() == 1
    policy.on_evict(1)
    assert policy.victim() == 0


def test_a_refilled_block_is_worth_nothing():
    # Blocks of 4, one request at a time, 3 blocks. R0 = [W w] and R1 = [X x] cache W and X;
    # Q = [Y q] needs one of them evicted. X's next lookup (R3 = [X z]) comes before W's
    # (R4 = [W v]), but R2 = [X], block-aligned, computes and caches X without a lookup
    # first: keeping X until then saves nothing, so Belady evicts X. R2 refills X (and, leaving
    # no partial block, fills the pool: W, Y, X), R3 hits X and evicts Y, R4 hits W: 2 blocks.
    # Evicting W instead (LRU, FIFO, and LFU by its tie-break: all evict the older W) loses R4:
    # 1 block. MRU evicts X, the block freed last, and happens to do the same as Belady.
    w_block, x_block, y_block = (list(range(base, base + 4)) for base in (100, 200, 300))
    prompts = [[*w_block, 1], [*x_block, 2], [*y_block, 3], x_block, [*x_block, 4], [*w_block, 5]]
    requests = [Request(np.array(prompt, np.int32), 1) for prompt in prompts]
    config = sequential_config(requests, 3)
    assert hit_blocks(requests, config, "belady") == 2
    for policy in ("lru", "fifo", "lfu"):
        assert hit_blocks(requests, config, policy) == 1
    assert hit_blocks(requests, config, "mru") == 2


def test_block_accesses_follow_the_scheduler():
    # Blocks of 4. A 9-token prompt looks up 2 blocks; an 8-token prompt looks up 1 and
    # computes its second without a lookup (a refill). A request caches (9 + max_tokens - 2)
    # // 4 blocks: with max_tokens=4, 2 (the block its third output token completes is never
    # cached: the request is released when its last step is planned); with 6, 3.
    assert num_cached_blocks(9, 4, BLOCK) == 2 and num_cached_blocks(9, 6, BLOCK) == 3
    prompt = np.arange(1, 10, dtype=np.int32)
    requests = [Request(prompt, 1), Request(prompt[:8], 1), Request(prompt, 6)]
    accesses = block_accesses(requests, BLOCK)
    first = next(h for h, positions in accesses.lookups.items() if positions == [0, 1, 2])
    second = next(h for h, positions in accesses.lookups.items() if positions == [0, 2])
    assert len(accesses.lookups) == 2
    # the second block, refilled by request 1; request 2's output block (token 9, then three
    # synthetic output tokens)
    assert accesses.refills[second] == [1] and sorted(accesses.refills.values()) == [[1], [2]]
    assert accesses.num_requests == 3
    policy = BeladyPolicy(accesses)
    assert policy.next_use(first, 1) == 1
    assert policy.next_use(second, 0) == 0
    assert policy.next_use(second, 1) == 3  # refilled at 1 before its lookup at 2: never


def test_belady_refuses_a_pool_of_other_blocks():
    requests = one_block_requests("ABA")
    with pytest.raises(ValueError, match="blocks of 8 tokens; the pool's hold 4"):
        simulate(
            requests, make_config(requests, block_size=4), BeladyPolicy.for_requests(requests, 8)
        )


def test_belady_refuses_a_run_that_admits_its_requests_in_another_order():
    """Built from the list, replayed by arrival time (another order): refused, not a wrong
    answer; built from the requests sorted by arrival time, it runs."""
    listed = one_block_requests("HABCADAECDADCBCABHAB")
    timed = [replace(r, arrival_time=float(len(listed) - i)) for i, r in enumerate(listed)]
    config = sequential_config(timed, 4)
    with pytest.raises(ValueError, match="request 0 of the run is not request 0"):
        simulate(timed, config, BeladyPolicy.for_requests(timed, BLOCK), arrival="time")
    arrived = sorted(timed, key=lambda request: request.arrival_time)
    policy = BeladyPolicy.for_requests(arrived, BLOCK)
    belady = simulate(timed, config, policy, arrival="time").num_hit_tokens
    assert belady >= simulate(timed, config, "lru", arrival="time").num_hit_tokens


def test_belady_needs_its_run():
    requests = one_block_requests("ABA")
    policy = BeladyPolicy.for_requests(requests, 4)
    policy.on_cache(0)
    with pytest.raises(RuntimeError, match="bind"):  # outside `simulate`, nothing binds it
        policy.priority(0)


@st.composite
def sequential_workloads(draw):
    """Requests that each cache at most one block, so that no block's hit needs another's:
    one-block bases plus a random suffix (block-aligned prompts included), outputs that fill
    no second block, token ids from a vocabulary of 3 (so output blocks of synthetic zeros recur
    in prompts) or 50; and a small cache."""
    vocab = draw(st.sampled_from([3, 50]))
    tokens = st.integers(0, vocab - 1)
    bases = draw(st.lists(st.lists(tokens, min_size=4, max_size=4), min_size=1, max_size=3))
    shapes = st.tuples(st.integers(0, len(bases) - 1), st.lists(tokens, max_size=3))
    requests = []
    for base, suffix in draw(st.lists(shapes, min_size=2, max_size=14)):
        prompt = bases[base] + suffix
        max_tokens = draw(st.integers(1, 2 * BLOCK + 1 - len(prompt)))
        assert num_cached_blocks(len(prompt), max_tokens, BLOCK) <= 1
        requests.append(Request(np.array(prompt, dtype=np.int32), max_tokens))
    largest = max(-(-(r.num_prompt_tokens + r.max_tokens - 1) // BLOCK) for r in requests)
    return requests, largest + draw(st.integers(0, 6))


@settings(max_examples=300, deadline=None)
@given(sequential_workloads())
def test_no_online_policy_beats_belady_one_request_at_a_time(workload):
    """With one request at a time and no block's hit depending on another's, the pool is a
    cache of fixed size and Belady's rule is optimal among the policies we have: none gets
    more hit tokens."""
    requests, num_blocks = workload
    config = sequential_config(requests, num_blocks)
    belady = hit_blocks(requests, config, "belady")
    for policy in POLICY_NAMES:
        assert hit_blocks(requests, config, policy) <= belady, policy


def test_a_chain_of_blocks_can_make_lru_beat_belady():
    """Belady's rule looks at each block alone, but a block hits only after its parent does:
    on this workload (found by hypothesis) LRU keeps a chain whole and gets more hits."""
    prompts = [
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 1],
        [0, 0, 0, 1, 0, 0, 0, 0, 0],
    ]
    requests = [Request(np.array(prompt, dtype=np.int32), 1) for prompt in prompts]
    config = sequential_config(requests, 5)
    assert hit_blocks(requests, config, "lru") == 3
    assert hit_blocks(requests, config, "belady") == 2


def test_admissions_in_one_step_can_beat_belady():
    """With several requests running, more hits can hurt: a request that hits needs fewer
    fresh blocks, so the next one fits into the same prefill step, and prompts prefilled
    together never hit each other's blocks.

    Bases P = [A B C] and Q = [E F G] (blocks of 4), 8 blocks, 2 running requests:
    R0 = P + 5 tokens, R1 = Q + 6, R2 = Q + 6, R3 = P + 1, R4 = P + 2. R2 hits E F G in both
    runs below. Belady keeps A for R3; R3 then needs 3 fresh blocks, and R4 fits into the same
    step: both hit A only (1 + 1 blocks). FIFO evicts A; R3 needs 4 and is admitted alone; R4
    comes a step later and hits A B C as R3 cached them (0 + 3 blocks).
    """
    p_tokens, q_tokens = list(range(1, 13)), list(range(101, 113))

    def own(count: int, start: int) -> list[int]:
        return list(range(start, start + count))

    requests = [
        Request(np.array(p_tokens + own(5, 1000), np.int32), 2),
        Request(np.array(q_tokens + own(6, 1100), np.int32), 2),
        Request(np.array(q_tokens + own(6, 1200), np.int32), 1),
        Request(np.array(p_tokens + own(1, 1300), np.int32), 1),
        Request(np.array(p_tokens + own(2, 1400), np.int32), 2),
    ]
    config = make_config(
        requests, 8, block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=16, prefill_tile=4
    )
    belady = simulate(requests, config, BeladyPolicy.for_requests(requests, BLOCK))
    fifo = simulate(requests, config, "fifo")
    assert belady.num_preemptions == fifo.num_preemptions == 0
    assert belady.num_hit_tokens == (3 + 1 + 1) * BLOCK
    assert fifo.num_hit_tokens == (3 + 0 + 3) * BLOCK


def test_research_stays_beside_the_engine():
    assert_import_leaves_out("jaxllm.research.belady", {"jax", "flax"})
    assert_import_leaves_out("jaxllm.cache, jaxllm.sched", {"jaxllm.research"})
