"""Scheduler scenarios with exact block ids, ref counts, hashes and chunk sizes.

Unless a test says otherwise: block size 4, prefill tile 4, a 16-token prefill budget, 16 blocks,
max_model_len 64, ignore_eos. `Harness.step` checks the descriptor contract, the fake device's
KV identities and `check_integrity()` at every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.sched import Harness, make_scheduler, make_seq

from jaxllm.cache import hash_block
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import SequenceStatus
from jaxllm.sched.processors import SequenceProcessors


def refs(scheduler, count: int) -> list[int]:
    return [scheduler.block_pool.ref_count(b) for b in range(count)]


def test_shared_prefix_shares_blocks_and_ref_counts():
    scheduler = make_scheduler()
    harness = Harness(scheduler)
    pool = scheduler.block_pool
    a = make_seq(scheduler, 10, max_tokens=4)  # tokens 100..109
    harness.step()
    assert a.block_table == [0, 1, 2] and a.num_computed_tokens == 10
    assert pool.block_hash(0) == hash_block(None, [100, 101, 102, 103])
    assert pool.block_hash(1) == hash_block(pool.block_hash(0), [104, 105, 106, 107])
    assert pool.block_hash(2) is None  # only 2 of its 4 tokens are computed

    b = make_seq(scheduler, [*range(100, 108), 1, 2], max_tokens=4)
    plan, _ = harness.step()
    assert plan.is_prefill and plan.seqs == [b]  # a waits: a step is all prefill
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8 and plan.num_new_tokens == [2]
    assert refs(scheduler, 5) == [2, 2, 1, 1, 0]

    harness.run()
    assert [a.finish_reason, b.finish_reason] == ["length", "length"]
    assert len(a.output_token_ids) == len(b.output_token_ids) == 4
    stats = scheduler.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens) == (20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    # Freed last-to-first, a before b: a's 4th block (4) and b's (5) never filled.
    assert list(pool.policy._evictable) == [2, 3, 1, 0]
    assert (stats.num_used_blocks, stats.num_cached_free_blocks, stats.num_empty_blocks) == (
        0,
        4,
        12,
    )


def test_full_prefix_hit_recomputes_the_last_block_and_dedups_it():
    scheduler = make_scheduler()
    harness = Harness(scheduler)
    pool = scheduler.block_pool
    a = make_seq(scheduler, 12, max_tokens=1)
    harness.run()
    assert a.finish_reason == "length"
    assert [pool.block_hash(b) is not None for b in range(4)] == [True, True, True, False]
    assert scheduler.stats().num_cached_free_blocks == 3

    b = make_seq(scheduler, 12, max_tokens=2)
    plan, _ = harness.step()
    # Every block of the prompt is cached, but the last one is recomputed (into a fresh block 3)
    # so that the step has a token to sample; then the copy is swapped for the cached block 2.
    assert b.num_cached_tokens == 8 and plan.num_new_tokens == [4]
    assert list(plan.inputs.block_tables[0]) == [0, 1, 3, 0]
    assert b.block_table == [0, 1, 2]
    assert refs(scheduler, 4) == [1, 1, 1, 0]

    c = make_seq(scheduler, 10, max_tokens=1)  # a prefix of the cached prompt, not block-aligned
    plan, finished = harness.step()
    assert plan.seqs == [c] and finished == [c]
    assert c.num_cached_tokens == 8 and plan.num_new_tokens == [2]
    assert list(plan.inputs.block_tables[0, :3]) == [0, 1, 3]
    assert refs(scheduler, 4) == [1, 1, 1, 0]
    harness.run()
    assert b.num_output_tokens == 2


def test_freed_blocks_stay_cached_and_are_reused():
    scheduler = make_scheduler(num_blocks=4)
    harness = Harness(scheduler)
    pool = scheduler.block_pool
    make_seq(scheduler, 9, max_tokens=1)
    harness.run()
    hashes = [pool.block_hash(0), pool.block_hash(1)]
    assert None not in hashes and pool.block_hash(2) is None
    stats = scheduler.stats()
    assert (stats.num_cached_free_blocks, stats.num_empty_blocks) == (2, 2)

    again = make_seq(scheduler, 9, max_tokens=2)
    plan, _ = harness.step()
    assert again.block_table == [0, 1, 2] and again.num_cached_tokens == 8
    assert list(plan.inputs.block_tables[0]) == [0, 1, 2, 0]
    assert refs(scheduler, 4) == [1, 1, 1, 0]
    assert [pool.block_hash(0), pool.block_hash(1)] == hashes
    assert scheduler.stats().num_evictions == 0


def cached_abc(policy: str):
    """Caches one block for each of a, b, c (block ids 0, 1, 2); a gets one hit in between.

    Free order afterwards: b, a, c. Cache order: a, b, c. Hits: a 1, b 0, c 0. Blocks 3-5 empty.
    """
    scheduler = make_scheduler(policy, num_blocks=6)
    harness = Harness(scheduler)
    prompts = {"a": [10, 11, 12, 13], "b": [20, 21, 22, 23], "c": [30, 31, 32, 33]}
    for name in "abhc":  # 5 tokens: the first block is cached, the second (1 token) is not
        seq = make_seq(scheduler, [*prompts[name.replace("h", "a")], 1 + (name == "h")], 1)
        harness.run()
        assert seq.num_cached_tokens == (4 if name == "h" else 0)
    hashes = {name: hash_block(None, prompt) for name, prompt in prompts.items()}
    pool = scheduler.block_pool
    assert {name: pool.cached_block(h) for name, h in hashes.items()} == {"a": 0, "b": 1, "c": 2}
    stats = scheduler.stats()
    assert (stats.num_cached_free_blocks, stats.num_empty_blocks) == (3, 3)
    return scheduler, harness, hashes


@pytest.mark.parametrize(
    ("policy", "eviction_order"),
    [("lru", "bac"), ("mru", "cab"), ("fifo", "abc"), ("lfu", "bca")],
)
def test_eviction_order_under_pressure(policy, eviction_order):
    for num_evicted in (1, 2, 3):
        scheduler, harness, hashes = cached_abc(policy)
        pool = scheduler.block_pool
        # Needs 3 + num_evicted blocks at admission: the 3 empty ones first, then evictions.
        big = make_seq(scheduler, [300 + i for i in range(4 * (3 + num_evicted) - 1)], 2)
        plan, _ = harness.step()
        assert plan.seqs == [big]
        gone = {name for name, h in hashes.items() if pool.cached_block(h) is None}
        assert gone == set(eviction_order[:num_evicted])
        assert scheduler.stats().num_evictions == num_evicted
        assert big.block_table[:3] == [3, 4, 5]
        assert big.block_table[3:] == ["abc".index(n) for n in eviction_order[:num_evicted]]
        scheduler.check_integrity()
        harness.run()


def test_chunked_prefill_of_a_prompt_longer_than_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8, num_blocks=16)
    harness = Harness(scheduler)
    long = make_seq(scheduler, 21, max_tokens=2)
    short = make_seq(scheduler, 3, max_tokens=1)
    chunks = []
    while long.num_output_tokens == 0:
        plan, _ = harness.step()
        assert plan.bucket.num_tokens <= 8
        chunks.append(list(zip(plan.seqs, plan.num_new_tokens, plan.samples, strict=True)))
    # The whole prompt's blocks are taken at admission; chunks are whole tiles until the last,
    # whose 5 tokens pad to 8 and fill the budget, so short waits one more step.
    assert chunks == [[(long, 8, False)], [(long, 8, False)], [(long, 5, True)]]
    assert long.block_table == [0, 1, 2, 3, 4, 5]
    plan, finished = harness.step()  # prefill first: short is admitted before long decodes
    assert plan.seqs == [short] and finished == [short]
    harness.run()
    assert long.num_output_tokens == 2


def test_prefill_budget_counts_tile_padding():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    harness = Harness(scheduler)
    first = make_seq(scheduler, 5)  # pads to 8 tokens: the whole budget
    second = make_seq(scheduler, 1)
    plan, _ = harness.step()
    assert plan.seqs == [first] and plan.bucket.num_tokens == 8
    plan, _ = harness.step()
    assert plan.seqs == [second]
    assert first.status is SequenceStatus.RUNNING


def test_preemption_frees_the_newest_and_resumes_from_the_prefix_cache():
    scheduler = make_scheduler(num_blocks=5, max_model_len=32)
    harness = Harness(scheduler)
    pool = scheduler.block_pool
    old = make_seq(scheduler, 7, max_tokens=10)  # 16 KV tokens at most: 4 blocks
    new = make_seq(scheduler, [*range(50, 57)], max_tokens=10)
    harness.step()
    assert (old.block_table, new.block_table) == ([0, 1], [2, 3])
    harness.step()  # decode: both at 8 tokens, still in 2 blocks, now both full and cached
    plan, _ = harness.step()  # both need a 3rd block; one is left: new is preempted
    assert plan.seqs == [old] and old.block_table == [0, 1, 4]
    assert new.status is SequenceStatus.WAITING and list(scheduler.waiting) == [new]
    assert new.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert new.block_table == [] and new.num_output_tokens == 2  # keeps its output
    # Its two full blocks stay cached (freed last to first: 3, then 2).
    assert list(pool.policy._evictable) == [3, 2]
    outputs_before = list(new.output_token_ids)

    while new.status is SequenceStatus.WAITING:
        plan, _ = harness.step()
    # old's 4th block evicted block 3 (LRU); when old finished, all its blocks were full and
    # stayed cached, so new resumes (prompt + 2 generated tokens = 9) with block 2 from the
    # cache and evicts old's least recently freed blocks 3 and 4 for the rest.
    assert scheduler.stats().num_evictions == 3 and old.is_finished
    assert plan.seqs == [new] and plan.start_positions == [4]
    assert plan.num_new_tokens == [5] and new.block_table == [2, 3, 4]
    harness.run()
    assert old.num_output_tokens == new.num_output_tokens == 10
    assert new.output_token_ids[:2] == outputs_before
    assert new.num_cached_tokens == 0 and scheduler.stats().num_hit_tokens == 4
    assert [s.finish_reason for s in (old, new)] == ["length", "length"]


def test_a_request_that_can_never_fit_is_refused_before_it_is_queued():
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        make_seq(scheduler, 64)
    with pytest.raises(ValueError, match="whole cache has 4"):
        make_seq(scheduler, 10, max_tokens=8)  # 17 KV tokens: 5 blocks
    with pytest.raises(ValueError, match="non-empty"):
        scheduler.new_sequence([], SamplingParams())
    with pytest.raises(ValueError, match="whole cache"):
        scheduler.new_sequence(list(range(10)), SamplingParams(max_tokens=8))
    scheduler.new_sequence(list(range(10)), SamplingParams(max_tokens=7))
    assert not scheduler.waiting and not scheduler.has_unfinished()
    fits = make_seq(scheduler, 10, max_tokens=7)  # 16 KV tokens: exactly the cache
    assert list(scheduler.waiting) == [fits]  # the refused requests never entered
    Harness(scheduler).run()
    assert fits.num_output_tokens == 7


def test_max_model_len_caps_max_tokens():
    scheduler = make_scheduler(max_model_len=12)
    seq = make_seq(scheduler, 9, max_tokens=100)
    assert seq.max_tokens == 3
    Harness(scheduler).run()
    assert (seq.num_output_tokens, seq.finish_reason, seq.num_tokens) == (3, "length", 12)


def test_stop_conditions():
    scheduler = make_scheduler(eos_token_ids=(7,))
    runs = {
        "eos": make_seq(scheduler, 3, max_tokens=5, ignore_eos=False),
        "ignore_eos": make_seq(scheduler, 3, max_tokens=5, ignore_eos=True),
        "stop_id": make_seq(scheduler, 3, max_tokens=5, stop_token_ids=[7]),
        "min_tokens": make_seq(scheduler, 3, max_tokens=5, ignore_eos=False, min_tokens=3),
    }
    batch = scheduler.schedule()
    # The fake sampler is replaced: every row samples 7 (eos and the stop id).
    assert scheduler.update(batch, [7] * 4) == [runs["eos"], runs["stop_id"]]
    assert runs["eos"].finish_reason == runs["stop_id"].finish_reason == "stop"
    assert runs["eos"].output_token_ids == [7]
    assert scheduler.update(scheduler.schedule(), [7, 7]) == []
    assert scheduler.update(scheduler.schedule(), [7, 7]) == [runs["min_tokens"]]
    assert runs["min_tokens"].output_token_ids == [7, 7, 7]
    scheduler.check_integrity()
    while scheduler.has_unfinished():
        scheduler.update(scheduler.schedule(), [7])
    assert runs["ignore_eos"].finish_reason == "length"
    assert runs["ignore_eos"].num_output_tokens == 5


def test_a_stop_token_on_the_last_token_max_tokens_allows_is_a_stop():
    """vLLM's order: stop tokens before max_tokens, so a stop token sampled as the last token
    max_tokens allows ends it as a stop (its text then left out of the output)."""
    scheduler = make_scheduler()
    seq = make_seq(scheduler, 3, max_tokens=2, stop_token_ids=[7])
    scheduler.update(scheduler.schedule(), [5])
    assert scheduler.update(scheduler.schedule(), [7]) == [seq]
    assert (seq.finish_reason, seq.output_token_ids) == ("stop", [5, 7])


def test_min_tokens_bans_reach_the_device_across_preemption():
    """The bias row the device holds (the plans' writes and edits replayed) bans the stop
    tokens exactly while fewer than min_tokens are out, also after a preemption whose
    recompute ends in chunks that sample nothing."""
    scheduler = make_scheduler(
        eos_token_ids=(7,), num_blocks=64, block_size=8, max_num_batched_tokens=16,
        max_model_len=128, prefill_tile=16, enable_prefix_caching=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=40, min_tokens=10, temperature=0)
    seq = scheduler.new_sequence(list(range(20, 40)), params, processors=SequenceProcessors(256))
    scheduler.add(seq)
    device_bans: set[int] = set()
    for step in range(30):
        if step == 16:  # 15 tokens out: preempted, recomputed in chunks of 16
            scheduler.running.remove(seq)
            scheduler._preempt(seq)
        plan = scheduler.schedule()
        processing = plan.processors
        for write in processing.writes if processing else ():
            device_bans = set(np.flatnonzero(np.isneginf(write.bias)).tolist())
        if processing is not None and processing.edits is not None:
            for token, value in zip(*processing.edits[1:], strict=True):
                (device_bans.add if np.isneginf(value) else device_bans.discard)(int(token))
        if plan.samples[0]:
            assert device_bans == ({7} if seq.num_output_tokens < 10 else set()), step
        scheduler.update(plan, [5] * plan.bucket.num_sampled)
    assert seq.num_preemptions == 1 and seq.num_output_tokens > 20


def test_finish_and_abort():
    scheduler = make_scheduler()
    harness = Harness(scheduler)
    waiting = make_seq(scheduler, 20)
    running = make_seq(scheduler, 3)
    early = make_seq(scheduler, 3, stop_strings=lambda token: True)  # its first token stops it
    assert scheduler.abort(waiting.seq_id) is waiting and waiting.finish_reason == "abort"
    assert scheduler.abort(waiting.seq_id) is None
    _, finished = harness.step()
    assert finished == [early] and early.finish_reason == "stop" and early.block_table == []
    assert early.num_output_tokens == 1
    scheduler.check_integrity()

    def abort_running(plan):
        assert running in plan.seqs
        scheduler.abort(running.seq_id)

    _, finished = harness.step(before_update=abort_running)
    assert finished == [] and running.finish_reason == "abort"
    assert running.num_output_tokens == 1  # the aborted step's token was dropped
    assert not scheduler.has_unfinished() and scheduler.stats().num_used_blocks == 0


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, prefill_tile=4)
    harness = Harness(scheduler)
    seqs = [make_seq(scheduler, 3, max_tokens=2) for _ in range(3)]
    plan, _ = harness.step()
    assert plan.seqs == seqs[:2] and list(scheduler.waiting) == [seqs[2]]
    plan, _ = harness.step()
    assert not plan.is_prefill and plan.seqs == seqs[:2]
    harness.run()


def test_prefix_caching_off_never_hashes():
    scheduler = make_scheduler(enable_prefix_caching=False)
    harness = Harness(scheduler)
    make_seq(scheduler, 9, max_tokens=1)
    harness.run()
    again = make_seq(scheduler, 9, max_tokens=1)
    harness.run()
    pool = scheduler.block_pool
    assert again.num_cached_tokens == 0 and again.block_hashes == []
    assert all(pool.block_hash(b) is None for b in range(pool.num_blocks))
    assert scheduler.stats().num_cached_free_blocks == 0


def test_sequence_ids_come_from_each_scheduler():
    first, second = make_scheduler(), make_scheduler()
    assert [make_seq(first, 2).seq_id, make_seq(first, 2).seq_id] == [0, 1]
    assert make_seq(second, 2).seq_id == 0


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_outlines_plan_what_full_plans_do(num_scheduler_steps):
    """Two schedulers in lockstep on one workload (shared prefixes, chunking, preemption):
    the one making outlines (the simulator's) plans the same sequences, counts, samples and
    buckets as the one building the device's arrays."""
    import numpy as np
    from support.sched import make_config

    from jaxllm.sched import Scheduler

    config = make_config(num_blocks=12, num_scheduler_steps=num_scheduler_steps)
    full, outline = Scheduler(config), Scheduler(config, outlines=True)
    rng = np.random.default_rng(0)
    for index in range(12):
        prompt = [*range(100, 108), *rng.integers(0, 50, int(rng.integers(1, 14))).tolist()]
        for scheduler in (full, outline):
            make_seq(scheduler, prompt, max_tokens=3 + index)
    steps = 0
    while full.has_unfinished():
        plans = full.schedule(), outline.schedule()
        if plans[0] is None:
            assert plans[1] is None
            continue
        a, b = plans
        assert b.inputs is None and b.sampling is None
        assert [s.seq_id for s in a.seqs] == [s.seq_id for s in b.seqs]
        assert (a.num_new_tokens, a.samples, a.bucket) == (b.num_new_tokens, b.samples, b.bucket)
        tokens = np.zeros((num_scheduler_steps, 8), np.int32)
        full.update(a, tokens)
        outline.update(b, tokens)
        steps += 1
    assert not outline.has_unfinished() and full.num_preemptions > 0 and steps > 10


def test_a_grammar_compiled_between_two_looks_does_not_fail_the_step():
    """The prefill pass passes over a sequence whose grammar compiles; if the compile ends
    before `schedule` looks again, the step is still empty (None), and the next admits it."""

    class Compiling:
        def __init__(self) -> None:
            self.looks = 0

        @property
        def ready(self) -> bool:
            self.looks += 1
            return self.looks > 1

    scheduler = make_scheduler()
    seq = scheduler.new_sequence(list(range(100, 106)), SamplingParams(max_tokens=2))
    seq.grammar = Compiling()
    scheduler.add(seq)
    assert scheduler.schedule() is None
    plan = scheduler.schedule()
    assert plan is not None and plan.seqs == [seq]


def test_a_request_that_cannot_hit_is_no_query():
    """As vLLM counts them: with prefix caching off, or prompt logprobs (computed whole),
    nothing is looked up, and the hit rate counts only lookups."""
    for settings, params in (({"enable_prefix_caching": False}, {}), ({}, {"prompt_logprobs": 1})):
        scheduler = make_scheduler(**settings)
        make_seq(scheduler, 9, **params)
        scheduler.schedule()
        assert scheduler.stats().num_queried_tokens == 0
    scheduler = make_scheduler()
    make_seq(scheduler, 9)
    scheduler.schedule()
    assert scheduler.stats().num_queried_tokens == 9


class Grammar:
    """A compiled grammar that goes on (`ended`: that admits nothing more)."""

    def __init__(self, ended: bool = False) -> None:
        self.ready, self.is_terminated, self.error = True, ended, None


def constrained_decode(stepwise_masks: bool):
    """A scheduler of plans of 4 decode steps whose one sequence (a prompt of 3 tokens, 12 to
    generate) has a grammar, its prompt applied; and the sequence."""
    scheduler = make_scheduler(num_scheduler_steps=4, stepwise_masks=stepwise_masks)
    seq = scheduler.new_sequence(
        list(range(100, 103)), SamplingParams(max_tokens=12, ignore_eos=True), grammar=Grammar()
    )
    scheduler.add(seq)
    scheduler.update(scheduler.schedule(), np.array([7]), accepted={0: 1})
    return scheduler, seq


def test_constrained_rows_take_plans_of_several_steps_only_with_stepwise_masks():
    """Without a mailbox (tensor parallelism) a constrained row takes plans of one step; with
    one, plans of several, up to its last token."""
    scheduler, _ = constrained_decode(stepwise_masks=False)
    plan = scheduler.schedule()
    assert plan.bucket.num_steps == 1 and plan.num_new_tokens == [1]
    scheduler, seq = constrained_decode(stepwise_masks=True)
    counts = []
    while (plan := scheduler.schedule()) is not None:
        counts.append(plan.num_new_tokens[0])
        scheduler.update(plan, np.full((plan.bucket.num_steps, 1), 9), accepted={0: counts[-1]})
    assert counts == [4, 4, 3] and seq.num_tokens == 3 + 12


def test_a_constrained_row_keeps_the_tokens_its_grammar_read_and_ends_at_the_last():
    """A grammar that ended two tokens into a plan of four: the row keeps those two and stops
    there; its blocks are freed and the scheduler stays consistent."""
    scheduler, seq = constrained_decode(stepwise_masks=True)
    plan = scheduler.schedule()
    seq.grammar = Grammar(ended=True)
    finished = scheduler.update(plan, np.arange(4)[:, None] + 20, accepted={0: 2})
    assert finished == [seq] and seq.output_token_ids == [7, 20, 21]
    assert seq.finish_reason == "stop" and not seq.block_table
    scheduler.check_integrity()
    assert scheduler.schedule() is None
