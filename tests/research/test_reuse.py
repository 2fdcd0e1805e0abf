"""Reuse distances and the LRU hit-rate curve: hand-counted distances, the curve against the
simulator's LRU at every cache size where it is exact, and how far off it is elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
from support.repo import assert_import_leaves_out

from jaxllm.research import workloads as w
from jaxllm.research.cache_sim import make_config, simulate
from jaxllm.research.reuse import lru_entries, reuse_profile
from jaxllm.research.workloads import Request

BLOCK = 16


def one_block_requests(names: str) -> list[Request]:
    """One request per letter: the letter's block plus one token of its own, max_tokens=1."""
    return [
        Request(np.array([*range(100 * ord(name), 100 * ord(name) + 16), 10_000 + k], np.int32), 1)
        for k, name in enumerate(names)
    ]


def sequential_config(requests, num_blocks, **overrides):
    settings = dict(block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=64, prefill_tile=16)
    return make_config(requests, num_blocks, **settings | overrides)


def test_hand_counted_distances():
    # A B A C B A: A, B and C are cold; the second A has B since (1), the second B has A and
    # C (2), the third A has C and B (2).
    profile = reuse_profile(one_block_requests("ABACBA"), BLOCK)
    assert profile.histogram.tolist() == [0, 1, 2]
    assert profile.num_cold_lookups == 3 and profile.num_lookups == 6
    assert [profile.hit_blocks(entries) for entries in range(5)] == [0, 0, 1, 3, 3]
    assert profile.num_queried_tokens == 6 * 17
    assert profile.hit_rate(3) == 3 * 16 / (6 * 17)
    requests = one_block_requests("ABACBA")
    for num_blocks, hits in ((3, 1), (4, 3)):  # 2 and 3 entries
        config = sequential_config(requests, num_blocks)
        assert lru_entries(requests, config) == num_blocks - 1
        assert simulate(requests, config, "lru").num_hit_tokens == hits * BLOCK


def test_a_prefix_is_more_recent_than_its_tail():
    # [A B x] then [A B y]: the first request frees B, then A; so A is at distance 0, B at 1,
    # and a cache of one entry hits the prefix A alone.
    prefix = list(range(1, 33))
    requests = [Request(np.array([*prefix, 100 + k], np.int32), 1) for k in range(2)]
    profile = reuse_profile(requests, BLOCK)
    assert profile.histogram.tolist() == [1, 1] and profile.num_cold_lookups == 2
    assert profile.hit_blocks(1) == 1 and profile.hit_blocks(2) == 2


EXACT_WORKLOADS = {
    # one block each, max_tokens 1 (docs/cache-policies.md's policy contrast)
    "hot_prefix_with_scans": lambda: w.hot_prefix_with_scans(4, 24, 8, seed=0),
    # 3-block prefixes drawn Zipf, a 5-token suffix, 3 output tokens (no output block cached)
    "prefix_repetition": lambda: w.prefix_repetition(120, 8, 48, 5, 3, zipf_exponent=1.0),
    # growing conversations whose outputs complete and cache blocks of their own
    "multi_turn_chat": lambda: w.multi_turn_chat(5, 5, 40, 16, 7, seed=0),
}


@pytest.mark.parametrize("name", EXACT_WORKLOADS)
def test_lru_curve_equals_the_simulator_at_every_size(name):
    requests = EXACT_WORKLOADS[name]()
    profile = reuse_profile(requests, BLOCK)
    largest = max(-(-(r.num_prompt_tokens + r.max_tokens - 1) // BLOCK) for r in requests)
    saturated = len(profile.histogram)  # entries from which every reuse hits
    curve = profile.hit_rate_curve(saturated + 2)
    assert curve[saturated] > curve[saturated - 1] >= curve[largest - 1]  # a real curve
    for num_blocks in range(largest, saturated + 4):
        config = sequential_config(requests, num_blocks)
        entries = lru_entries(requests, config)
        assert entries == num_blocks - 1
        result = simulate(requests, config, "lru")
        assert result.num_hit_tokens == profile.hit_blocks(entries) * BLOCK, num_blocks
        assert result.hit_rate == pytest.approx(curve[entries], abs=1e-12)


def test_block_aligned_prompts_leave_no_partial_block():
    # Prompts of 3 + 1 full blocks (the last one their own), max_tokens 1: no partial block,
    # so a pool of N blocks holds N cached blocks at each lookup.
    requests = w.prefix_repetition(120, 8, 48, 16, 1, zipf_exponent=1.0)
    profile = reuse_profile(requests, BLOCK)
    for num_blocks in (4, 8, 16, 32):
        config = sequential_config(requests, num_blocks)
        assert lru_entries(requests, config) == num_blocks
        result = simulate(requests, config, "lru")
        assert result.num_hit_tokens == profile.hit_blocks(num_blocks) * BLOCK


def test_conditions_that_break_the_prediction_are_detected():
    # Identical block-aligned prompts: each computes its last block without a lookup, and when
    # a copy is cached it takes the copy over, leaving one more empty block behind; so the pool
    # holds a varying number of cached blocks, and the curve is off.
    requests = w.prefix_repetition(120, 8, 48, 0, 1, zipf_exponent=1.0)
    profile = reuse_profile(requests, BLOCK)
    off = 0
    for num_blocks in range(3, 40):
        config = sequential_config(requests, num_blocks)
        assert lru_entries(requests, config) is None
        predicted = profile.hit_blocks(num_blocks - 1) * BLOCK
        off += simulate(requests, config, "lru").num_hit_tokens != predicted
    assert off > 0
    exact = EXACT_WORKLOADS["prefix_repetition"]()
    assert lru_entries(exact, sequential_config(exact, 16, max_num_seqs=2)) is None
    assert lru_entries(exact, sequential_config(exact, 16, enable_prefix_caching=False)) is None
    # the profile caches output blocks by each request's max_tokens: none may be cut
    prompt = np.arange(1, 18)  # a block and a token
    cut = [Request(prompt, 1), Request(prompt + 100, 40), Request(np.r_[prompt[:16], 999], 1)]
    assert lru_entries(cut, sequential_config(cut, 4)) == 3
    config = sequential_config(cut, 4, max_model_len=48)  # the second's 40 cut to 31
    assert lru_entries(cut, config) is None
    predicted = reuse_profile(cut, BLOCK).hit_blocks(3) * BLOCK
    assert simulate(cut, config, "lru").num_hit_tokens != predicted  # what it would vouch for


def test_several_running_requests_hit_less_than_the_curve():
    """With 4 requests running, their blocks take room from the cache and prompts prefilled in
    one step miss each other's blocks: the simulator's LRU stays below the sequential curve,
    by at most 0.16 here (the tolerance `lru_entries` states)."""
    requests = w.prefix_repetition(400, 12, 48, 5, 3, zipf_exponent=1.0, seed=1)
    profile = reuse_profile(requests, BLOCK)
    gaps = []
    for num_blocks in (8, 16, 24, 32, 48, 64, 128):
        config = make_config(
            requests, num_blocks, block_size=BLOCK, max_num_seqs=4, prefill_tile=16,
            max_num_batched_tokens=256,
        )  # fmt: skip
        assert lru_entries(requests, config) is None
        gaps.append(profile.hit_rate(num_blocks - 1) - simulate(requests, config, "lru").hit_rate)
    assert all(0 < gap <= 0.16 for gap in gaps), gaps


def test_curve_is_cumulative():
    profile = reuse_profile(EXACT_WORKLOADS["prefix_repetition"](), BLOCK)
    curve = profile.hit_rate_curve(len(profile.histogram) + 5)
    assert curve[0] == 0 and np.all(np.diff(curve) >= 0)
    assert curve.tolist() == [profile.hit_rate(entries) for entries in range(len(curve))]


def test_reuse_imports_no_jax():
    assert_import_leaves_out("jaxllm.research.reuse", {"jax", "flax"})
