"""Step plans: ladder shapes, tile front padding, slot mapping, sampled rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.sched import Harness, assert_plan_contract, make_config, make_scheduler, make_seq

from jaxllm.model.inputs import fill_chunks
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Bucket, BucketLadder
from jaxllm.sched.plan import _fill_decode


def test_ladder_rungs_and_buckets():
    config = make_config(
        block_size=16,
        max_num_seqs=48,
        max_num_batched_tokens=96,
        max_model_len=200,
        prefill_tile=16,
    )
    ladder = BucketLadder.from_config(config)
    assert ladder.decode_sizes == (1, 2, 4, 8, 16, 32, 48)
    assert ladder.prefill_sizes == (16, 32, 64, 96)
    assert ladder.widths == (1, 2, 4, 8, 13)  # ceil(200 / 16) = 13
    shapes = ladder.buckets()
    assert len(shapes) == len(set(shapes)) == 7 * 5 + 4 * 5
    assert Bucket("decode", 32, 32, 32, 8) in shapes
    assert Bucket("prefill", 64, 4, 4, 13) in shapes
    assert ladder.decode_bucket(5, 3) == Bucket("decode", 8, 8, 8, 4)
    assert ladder.prefill_bucket(80, 9) == Bucket("prefill", 96, 6, 6, 13)
    with pytest.raises(ValueError, match="beyond"):
        ladder.decode_bucket(49, 1)
    with pytest.raises(ValueError, match="beyond"):
        ladder.prefill_bucket(16, 14)

    one_width = BucketLadder.from_config(config, one_width=True)
    assert one_width.widths == (13,)
    assert len(one_width.buckets()) == 7 + 4
    assert one_width.decode_bucket(5, 3) == Bucket("decode", 8, 8, 8, 13)


def test_multi_step_buckets_hold_at_least_eight_rows():
    config = make_config(max_num_seqs=48, num_scheduler_steps=4)
    ladder = BucketLadder.from_config(config)
    assert ladder.multi_step_sizes == (8, 16, 32)  # none of 48: MULTI_STEP_MAX_SEQS
    assert ladder.decode_bucket(1, 1, 4) == Bucket("decode", 8, 8, 8, 1, 4)
    assert ladder.decode_bucket(1, 1) == Bucket("decode", 1, 1, 1, 1)  # one step: as it is
    assert {b.num_tokens for b in ladder.buckets() if b.num_steps == 4} == {8, 16, 32}
    with pytest.raises(ValueError, match="no decode bucket of 4 steps for 33"):
        ladder.decode_bucket(33, 1, 4)
    small = BucketLadder.from_config(make_config(max_num_seqs=4, num_scheduler_steps=4))
    assert small.multi_step_sizes == (4,)  # never more rows than max_num_seqs


def test_every_built_shape_is_on_the_ladder():
    scheduler = make_scheduler(num_blocks=12, max_num_seqs=5)
    harness = Harness(scheduler)
    shapes = set(scheduler.ladder.buckets())
    for k in range(9):
        make_seq(scheduler, 2 + 3 * k, max_tokens=1 + k % 4)
    seen = set()
    while scheduler.has_unfinished():
        plan, _ = harness.step()
        seen.add(plan.bucket)
    assert seen <= shapes and {shape.kind for shape in seen} == {"prefill", "decode"}


def test_prefill_tiles_are_front_padded():
    scheduler = make_scheduler()  # block size 4, tile 4, budget 16
    a = make_seq(scheduler, [10, 11, 12, 13, 14, 15], temperature=0.5, top_k=3, seed=9)
    b = make_seq(scheduler, [20, 21, 22], top_p=0.8, min_p=0.1)
    plan = scheduler.schedule()
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    assert plan.bucket == Bucket("prefill", 16, 4, 4, 2)
    # a: 6 tokens in 2 tiles (2 padding rows first); b: 3 tokens in 1 tile; 1 padding tile.
    assert plan.inputs.token_ids.tolist() == [
        0,
        0,
        10,
        11,
        12,
        13,
        14,
        15,
        0,
        20,
        21,
        22,
        0,
        0,
        0,
        0,
    ]
    assert plan.inputs.positions.tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 0, 0, 0, 0]
    assert plan.inputs.slot_mapping.tolist() == [-1, -1, 0, 1, 2, 3, 4, 5, -1, 8, 9, 10] + [-1] * 4
    assert plan.inputs.block_tables.tolist() == [[0, 1], [0, 1], [2, 0], [0, 0]]
    assert plan.inputs.context_lens.tolist() == [2, 6, 3, 0]
    assert plan.inputs.sample_indices.tolist() == [7, 11, 0, 0]
    assert plan.sampling.temperature.tolist() == [0.5, 1.0, 0.0, 0.0]  # padding rows are greedy
    assert plan.sampling.top_k.tolist() == [3, 0, 0, 0]
    assert plan.sampling.top_p.tolist() == pytest.approx([1.0, 0.8, 1.0, 1.0])
    assert plan.sampling.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0, 0.0])
    assert plan.sampling.seeds.tolist() == [9, 0, 0, 0] and plan.sampling.steps.tolist() == [
        0,
        0,
        0,
        0,
    ]
    assert plan.seqs == [a, b] and plan.samples == [True, True]
    assert (plan.num_seqs, plan.num_tokens) == (2, 9)
    assert set(plan.inputs._fields) == {
        "token_ids", "positions", "slot_mapping", "block_tables", "context_lens", "sample_indices"
    }  # fmt: skip


def test_prefill_chunk_after_a_prefix_hit_starts_mid_sequence():
    scheduler = make_scheduler()
    harness = Harness(scheduler)
    make_seq(scheduler, 12, max_tokens=1)
    harness.run()
    seq = make_seq(scheduler, [*range(100, 110)], max_tokens=2)  # 8 cached, 2 to compute
    plan = scheduler.schedule()
    assert seq.block_table == [0, 1, 3]
    assert plan.bucket == Bucket("prefill", 4, 1, 1, 4)
    assert plan.inputs.positions.tolist() == [0, 0, 8, 9]
    assert plan.inputs.token_ids.tolist() == [0, 0, 108, 109]
    assert plan.inputs.slot_mapping.tolist() == [-1, -1, 12, 13]  # block 3, offsets 0 and 1
    assert plan.inputs.context_lens.tolist() == [10] and plan.inputs.sample_indices.tolist() == [3]
    assert plan.inputs.block_tables.tolist() == [[0, 1, 3, 0]]


def test_decode_rows_slots_and_sampling_arrays():
    scheduler = make_scheduler()
    harness = Harness(scheduler)
    seqs = [
        make_seq(scheduler, 3, max_tokens=9, temperature=0.0),
        make_seq(scheduler, 5, max_tokens=9, seed=2**40 + 5),
        make_seq(scheduler, [50, 51, 52, 53], max_tokens=9, seed=2**41 + 5),
    ]
    harness.step()  # one prefill step for all three: 4 + 8 + 4 padded tokens
    harness.step()  # a decode step: the third sequence takes block 4
    plan = scheduler.schedule()  # the first takes block 5
    assert [s.block_table for s in seqs] == [[0, 5], [1, 2], [3, 4]]
    assert not plan.is_prefill and plan.bucket == Bucket("decode", 4, 4, 4, 2)
    assert plan.inputs.positions.tolist() == [4, 6, 5, 0]  # each sequence's last token
    assert plan.inputs.token_ids.tolist() == [s.output_token_ids[-1] for s in seqs] + [0]
    assert plan.inputs.slot_mapping.tolist() == [5 * 4 + 0, 2 * 4 + 2, 4 * 4 + 1, -1]
    assert plan.inputs.context_lens.tolist() == [5, 7, 6, 0]
    assert plan.inputs.sample_indices.tolist() == [0, 1, 2, 0]
    assert plan.inputs.block_tables.tolist() == [[0, 5], [1, 2], [3, 4], [0, 0]]
    assert plan.sampling.temperature.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert plan.sampling.steps.tolist() == [2, 2, 2, 0]
    # Seeds fold to 32 bits; seeds that differ only above bit 32 stay different.
    assert (
        plan.sampling.seeds.dtype == np.uint32 and len(set(plan.sampling.seeds[:3].tolist())) == 3
    )
    assert_plan_contract(plan, scheduler.config)


def test_seeds_below_2_to_32_are_kept_and_unseeded_use_the_derived_seed():
    scheduler = make_scheduler()
    make_seq(scheduler, 2, seed=123)
    scheduler.add(scheduler.new_sequence([1, 2], SamplingParams(_derived_seed=77)))
    plan = scheduler.schedule()
    assert plan.sampling.seeds[:2].tolist() == [123, 77]


def test_large_steps_have_the_largest_shapes():
    config = make_config(
        num_blocks=2048, block_size=256, max_num_seqs=256, max_num_batched_tokens=16384,
        max_model_len=32768, prefill_tile=128,
    )  # fmt: skip
    scheduler = make_scheduler(**config.__dict__)
    make_seq(scheduler, 16384, max_tokens=1)
    plan = scheduler.schedule()
    assert plan.bucket == Bucket("prefill", 16384, 128, 128, 64)
    assert plan.inputs.slot_mapping.tolist() == list(range(16384))
    assert plan.inputs.context_lens.tolist() == list(range(128, 16385, 128))


def test_greedy_requests_in_a_padded_bucket_take_the_greedy_sampler():
    """Padding rows must not make the host pick a costlier sampler than the real rows need; a
    greedy row's filters are off, whatever it asked."""
    from jaxllm.model.sampler import sampler_mode

    scheduler = make_scheduler()
    harness = Harness(scheduler)
    make_seq(scheduler, 3, max_tokens=4, temperature=0.0, top_k=2**40)
    make_seq(scheduler, 5, max_tokens=4, temperature=0.0)
    make_seq(scheduler, 2, max_tokens=4, temperature=0.0)
    for _ in range(2):  # the prefill step, then a decode step: 3 rows in a bucket of 4
        plan, _ = harness.step()
        assert plan.bucket.num_sampled == 4
        assert plan.sampling.top_k.tolist() == [0, 0, 0, 0]
        assert (
            sampler_mode(
                plan.sampling.temperature,
                plan.sampling.top_k,
                plan.sampling.top_p,
                plan.sampling.min_p,
                1000,
            )
            == "greedy"
        )


def test_multi_step_rows_past_their_steps_attend_within_their_table():
    """A sequence with fewer tokens left than the plan's steps: its later steps write nowhere
    and attend to nothing, so no context runs past its block table (the fake device checks)."""
    scheduler = make_scheduler(num_scheduler_steps=4)
    seq = make_seq(scheduler, 6, max_tokens=3)
    harness = Harness(scheduler)
    plans = [harness.step()[0] for _ in range(2)]
    multi = plans[1]
    assert multi.bucket.num_steps == 4 and multi.num_new_tokens == [2]
    assert multi.step_slots[:, 0].tolist()[2:] == [-1, -1]
    harness.run()
    assert seq.output_token_ids and seq.finish_reason == "length"


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_seqs=st.integers(1, 6),
    width=st.integers(1, 5),
    data=st.data(),
)
def test_decode_layout_is_the_tile_layout_of_one_token_tiles(block_size, num_seqs, width, data):
    """A decode step's layout (`_fill_decode`) equals the general one (`fill_chunks`) for
    tiles of one token, one per sequence, in a padded bucket."""
    tables = np.array(
        data.draw(st.lists(st.lists(st.integers(0, 99), min_size=width, max_size=width),
                           min_size=num_seqs, max_size=num_seqs)),
        np.int32,
    )  # fmt: skip
    starts = np.array(
        data.draw(st.lists(st.integers(0, width * block_size - 1), min_size=num_seqs,
                           max_size=num_seqs)),
    )  # fmt: skip
    bucket = Bucket("decode", num_seqs + 2, num_seqs + 2, num_seqs + 2, width + 1)
    fast, general = bucket.padding()[0], bucket.padding()[0]
    rows = _fill_decode(fast, tables, starts, block_size)
    expected = fill_chunks(general, tables, starts, np.ones_like(starts), block_size)
    assert rows.tolist() == expected.tolist()
    for name, array in fast._asdict().items():
        assert array.tolist() == getattr(general, name).tolist(), name
