"""Policy hooks: what the pool tells a policy of a block (the request's metadata, the clock,
hits, position) and admission; and the two policies built on them."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.cache.block_pool import BlockPool
from jaxllm.cache.eviction import LRUPolicy
from jaxllm.cache.hashing import extend_block_hashes
from jaxllm.research import workloads as w
from jaxllm.research.cache_sim import make_config, simulate
from jaxllm.research.policies import PrefixCostPolicy, SessionPolicy

BLOCK = 4


class Recording(LRUPolicy):
    """LRU that records what it is told of each block it admits."""

    name = "recording"

    def __init__(self, keep: bool = True) -> None:
        super().__init__()
        self.keep, self.seen = keep, {}

    def admit(self, block_id: int) -> bool:
        self.seen[block_id] = self.info(block_id)
        return self.keep


def cached_table(pool: BlockPool, tokens: list[int]) -> list[int]:
    """A table for `tokens` (whole blocks), prefix hits reused, every block cached."""
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BLOCK)
    hit = pool.find_cached_prefix(tokens, hashes, len(hashes))
    table = pool.allocate(hit, len(hashes) - len(hit))
    pool.cache_blocks(table, tokens, hashes, len(hit), len(hashes))
    return table


def test_a_policy_sees_metadata_time_hits_and_position():
    now = [10.0]
    policy = Recording()
    pool = BlockPool(8, BLOCK, eviction_policy=policy, clock=lambda: now[0])
    prompt = list(range(12))  # three blocks
    pool.free(cached_table(pool, prompt), {"tenant": "a"})
    now[0] = 12.5
    table = cached_table(pool, prompt)  # three hits
    pool.free(table, {"tenant": "b"})
    assert [policy.seen[block].position for block in table] == [0, 1, 2]
    assert all(policy.seen[block].num_hits == 1 for block in table)
    assert all(policy.seen[block].metadata == {"tenant": "b"} for block in table)
    assert all(policy.seen[block].time == 12.5 for block in table)
    assert all(policy.seen[block].holder_blocks == 3 for block in table)
    pool.check_integrity([])


def test_on_cache_sees_the_request_that_filled_the_block():
    """A block freed by one request and filled by the next: `on_cache` reads the filler's
    metadata and blocks, not those of the request before (the simulator runs the scheduler)."""

    class OnCache(LRUPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[dict, int]] = []

        def on_cache(self, block_id: int) -> None:
            info = self.info(block_id)
            self.seen.append((dict(info.metadata), info.holder_blocks))

    requests = [
        w.Request(np.arange(20), 1, metadata={"tenant": "a"}),
        w.Request(np.arange(100, 140), 1, metadata={"tenant": "b"}),
    ]
    config = make_config(requests, 4, block_size=16, max_num_seqs=1, prefill_tile=16)
    policy = OnCache()
    simulate(requests, config, policy)
    assert policy.seen == [({"tenant": "a"}, 2), ({"tenant": "b"}, 3), ({"tenant": "b"}, 3)]


def test_an_admit_that_answers_none_is_named():
    class Forgetful(LRUPolicy):
        def admit(self, block_id: int):  # a forgotten `return True`
            super().admit(block_id)

    pool = BlockPool(8, BLOCK, eviction_policy=Forgetful())
    with pytest.raises(RuntimeError, match=r"Forgetful\.admit\(\d\) returned None, not a bool"):
        pool.free(cached_table(pool, list(range(8))))


def test_a_block_not_admitted_is_forgotten():
    pool = BlockPool(8, BLOCK, eviction_policy=Recording(keep=False))
    prompt = list(range(8))
    pool.free(cached_table(pool, prompt))
    stats = pool.stats()
    assert (stats.num_cached_free_blocks, stats.num_empty_blocks) == (0, 8)
    hashes: list[int] = []
    extend_block_hashes(hashes, prompt, BLOCK)
    assert pool.find_cached_prefix(prompt, hashes, 2) == []
    pool.check_integrity([])


def shared_prefixes() -> list[w.Request]:
    return w.shared_prefix(4, 4, 64, 8, 8, order="grouped", vocab_size=256, seed=1)


def test_refusing_every_block_gives_no_hits_in_the_simulator():
    """One request at a time: a block is shared while its holder runs, whatever the policy;
    admission decides what stays once it is freed."""
    requests = shared_prefixes()
    config = make_config(requests, 64, block_size=16, prefill_tile=16, max_num_seqs=1)
    assert simulate(requests, config, "lru").num_hit_tokens > 0
    refused = simulate(requests, config, Recording(keep=False), check_integrity=True)
    assert refused.num_hit_tokens == 0


def test_refusing_every_block_gives_no_hits_in_the_engine(make_llm):
    llm = make_llm(eviction_policy=Recording(keep=False))
    prompts = [r.prompt_token_ids.tolist() for r in shared_prefixes()]
    params = SamplingParams(temperature=0.0, max_tokens=4, extra_args={"tenant": "x"})
    before = llm.cache_stats().num_hit_tokens
    for prompt in prompts:  # one at a time (see above)
        llm.generate([prompt], params, use_tqdm=False)
    assert llm.cache_stats().num_hit_tokens == before
    seen = llm.engine.scheduler.block_pool.policy.seen
    assert seen and all(info.metadata == {"tenant": "x"} for info in seen.values())
    lru = make_llm(eviction_policy=Recording(keep=True))
    for prompt in prompts:
        lru.generate([prompt], params, use_tqdm=False)
    assert lru.cache_stats().num_hit_tokens > 0


def test_prefix_cost_keeps_longer_requests_blocks_longer():
    """A request of three blocks freed at t=0 (priority 0 + 3 * 10) outlasts one of one block
    freed at t=5 (5 + 10); within a request the tail goes first, as under LRU."""
    now = [0.0]
    pool = BlockPool(4, BLOCK, eviction_policy=PrefixCostPolicy(10.0), clock=lambda: now[0])
    long = cached_table(pool, list(range(12)))
    pool.free(long)
    now[0] = 5.0
    short = cached_table(pool, [99] * 4)
    pool.free(short)
    order = [pool.allocate([], 1)[0] for _ in range(4)]
    assert order == [*short, *reversed(long)]


def test_session_policy_keeps_sessions_and_evicts_low_priority_first():
    pool = BlockPool(3, BLOCK, eviction_policy=SessionPolicy())
    (high,) = cached_table(pool, [1] * 4)
    pool.free([high], {"session_id": "s", "priority": 2})
    (none,) = cached_table(pool, [2] * 4)
    pool.free([none], {"priority": 5})  # no session: not kept
    (low,) = cached_table(pool, [3] * 4)
    pool.free([low], {"session_id": "t", "priority": 0})
    stats = pool.stats()
    assert (stats.num_cached_free_blocks, stats.num_empty_blocks) == (2, 1)
    assert pool.allocate([], 3)[1:] == [low, high]  # after the empty one: priority 0 first


@pytest.mark.parametrize("policy", [PrefixCostPolicy, SessionPolicy])
def test_hook_policies_run_a_timed_trace_in_the_simulator(policy):
    requests = w.with_poisson_arrivals(shared_prefixes(), 50.0, seed=0)
    requests = [
        w.Request(r.prompt_token_ids, r.max_tokens, r.arrival_time, {"session_id": i % 2})
        for i, r in enumerate(requests)
    ]
    result = simulate(
        requests, make_config(requests, 12, block_size=16, prefill_tile=16), policy(),
        arrival="time", step_time=0.01,
        check_integrity=True,
    )  # fmt: skip
    assert result.num_hit_tokens > 0 and result.num_evictions > 0
    assert np.isfinite(result.mean_ttft_seconds)
