"""Property tests: random interleavings of add / step / finish / abort over shared prefixes.

Every step goes through the fake device, which recomputes each token's prefix identity through
the block tables (so wrong KV from a bad cache hit, slot or table fails the test), and is
followed by `check_integrity()`. At the end every block is free and every request finished
exactly once, with exactly its max_tokens unless it was aborted or finished early.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.sched import VOCAB, Harness, expected_identities, make_config, next_token

from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, Sequence
from jaxllm.sched.processors import SequenceProcessors

POLICIES = ["lru", "fifo", "lfu", "mru"]

# NOTE: repeated kinds weight the draw towards adds and steps.
KINDS = ["add"] * 4 + ["step"] * 5 + ["step_then_abort", "abort", "finish"]


@st.composite
def operations(draw):
    kind = draw(st.sampled_from(KINDS))
    if kind == "add":
        base = draw(st.integers(0, 2))  # which shared base
        length = draw(st.integers(0, 16) | st.just(16))  # how much of it
        suffix = draw(st.lists(st.integers(0, 9), max_size=4))  # a private suffix
        return ("add", base, length, suffix, draw(st.integers(1, 12)))
    if kind == "step":
        return ("step",)
    return (kind, draw(st.integers(0, 100)))


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    tile = draw(st.sampled_from([1, 2, 4, 8]))
    config = make_config(
        block_size=block_size,
        prefill_tile=tile,
        max_num_batched_tokens=tile * draw(st.integers(1, 6)),
        max_model_len=draw(st.integers(8, 48)),
        num_blocks=max(1, draw(st.integers(8, 64)) // block_size),
        max_num_seqs=draw(st.integers(1, 6)),
        enable_prefix_caching=draw(st.sampled_from([True, True, True, False])),
    )
    bases = draw(
        st.lists(st.lists(st.integers(0, 9), min_size=16, max_size=16), min_size=3, max_size=3)
    )
    ops = draw(st.lists(operations(), min_size=10, max_size=60))
    return config, draw(st.sampled_from(POLICIES)), bases, ops


def never_fits(config, prompt: list[int], max_tokens: int) -> bool:
    if len(prompt) >= config.max_model_len:
        return True
    effective = min(max_tokens, config.max_model_len - len(prompt))
    return -(-(len(prompt) + effective - 1) // config.block_size) > config.num_blocks


def run_workload(config, policy, bases, ops) -> Scheduler:
    scheduler = Scheduler(config, eviction_policy=policy)
    harness = Harness(scheduler)
    accepted: list[Sequence] = []
    ended_early: dict[int, str] = {}  # seq_id -> "abort"
    stopped: set[int] = set()  # sequences told to stop at their next token (a stop string)

    def live(seqs):
        return [seq for seq in seqs if not seq.is_finished]

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, base, length, suffix, max_tokens = op
            prompt = bases[base][:length] + suffix
            # Every other request holds a logits processors' slot while it runs.
            processors = SequenceProcessors(VOCAB) if len(accepted) % 2 else None
            penalty = 1.2 if processors else 1.0
            params = SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, repetition_penalty=penalty
            )
            if not prompt or never_fits(config, prompt, max_tokens):
                with pytest.raises(ValueError):
                    scheduler.new_sequence(prompt, params)
                continue
            seq = scheduler.new_sequence(prompt, params, processors=processors)
            scheduler.add(seq)
            assert seq.max_tokens == min(max_tokens, config.max_model_len - len(prompt))
            accepted.append(seq)
        elif kind == "step":
            harness.step()
        elif kind == "step_then_abort":

            def abort_one(plan, pick=op[1]):
                victim = plan.seqs[pick % plan.num_seqs]
                scheduler.abort(victim.seq_id)
                ended_early[victim.seq_id] = "abort"

            harness.step(before_update=abort_one)
        elif kind == "abort" and live(accepted):
            victim = live(accepted)[op[1] % len(live(accepted))]
            assert scheduler.abort(victim.seq_id) is victim
            ended_early[victim.seq_id] = "abort"
        elif kind == "finish" and scheduler.running:
            victim = scheduler.running[op[1] % len(scheduler.running)]
            victim.stop_strings = lambda token: True  # a stop string ends its next token
            stopped.add(victim.seq_id)
        scheduler.check_integrity()

    harness.run(max_steps=5000)

    stats = scheduler.stats()
    assert stats.num_used_blocks == 0 and not scheduler.running and not scheduler.waiting
    assert stats.num_cached_free_blocks + stats.num_empty_blocks == config.num_blocks
    scheduler.check_integrity()
    finished_ids = [seq.seq_id for seq in harness.finished]
    assert len(finished_ids) == len(set(finished_ids)), "a request finished twice"
    assert not set(finished_ids) & set(ended_early), "an aborted request also finished"
    assert set(finished_ids) | set(ended_early) == {seq.seq_id for seq in accepted}
    for seq in accepted:
        assert seq.is_finished and seq.block_table == []
        if seq.seq_id in ended_early:
            assert seq.finish_reason == ended_early[seq.seq_id]
            assert seq.num_output_tokens <= seq.max_tokens
        elif seq.seq_id in stopped:
            assert seq.finish_reason == "stop"
            assert seq.num_output_tokens <= seq.max_tokens
        else:
            assert seq.finish_reason == "length"
            assert seq.num_output_tokens == seq.max_tokens
        identities = expected_identities(seq.token_ids)
        for k, token in enumerate(seq.output_token_ids):
            assert token == next_token(identities[seq.num_prompt_tokens + k - 1])
    return scheduler


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_interleavings_keep_every_invariant(workload):
    run_workload(*workload)


def test_random_workloads_exercise_hits_evictions_and_preemptions():
    """Guards the property test's reach: the same machinery, seeded, must hit every path."""
    rng = random.Random(0)
    totals = dict(hits=0, evictions=0, preemptions=0)
    for policy in POLICIES:
        for _ in range(10):
            config = make_config(
                block_size=rng.choice([2, 4]),
                prefill_tile=2,
                max_num_batched_tokens=8,
                max_model_len=32,
                num_blocks=12,
                max_num_seqs=4,
            )
            bases = [[rng.randrange(10) for _ in range(16)] for _ in range(2)]
            ops = []
            for _ in range(40):
                if rng.random() < 0.4:
                    ops.append(("add", rng.randrange(2), rng.randrange(17), [rng.randrange(10)], 8))
                else:
                    ops.append(("step",))
            scheduler = run_workload(config, policy, bases, ops)
            stats = scheduler.stats()
            totals["hits"] += stats.num_hit_tokens
            totals["evictions"] += stats.num_evictions
            totals["preemptions"] += scheduler.num_preemptions
    assert totals["hits"] and totals["evictions"] and totals["preemptions"], totals
