"""Scheduling one step ahead: `commit` a step when it is dispatched, `apply` its tokens a step
late. The outputs must equal the synchronous `update` path's, step for step in content."""

from __future__ import annotations

import numpy as np
import pytest
from sched_helpers import FakeDevice, Harness, make_config

from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import PLACEHOLDER, BatchBuilder, Scheduler


def run_async(scheduler: Scheduler, max_steps: int = 2000) -> int:
    """The engine's pipelined loop over the fake device: schedule and dispatch step N, apply
    step N-1's tokens, then commit step N. Placeholder inputs are read from step N-1's tokens,
    as the device does. Returns how many placeholder inputs were read."""
    builder = BatchBuilder(scheduler.config)
    device = FakeDevice(scheduler.config.num_blocks, scheduler.config.block_size)
    pending = None
    num_read = 0
    for _ in range(max_steps):
        batch = scheduler.schedule()
        sampled = None
        if batch is not None:
            desc = builder.build(batch)
            token_ids = desc.token_ids.copy()
            placeholders = np.flatnonzero(token_ids[: desc.num_tokens] == PLACEHOLDER)
            if len(placeholders):
                assert not batch.is_prefill, "a prefill chunk read a placeholder"
                previous_row = {seq.seq_id: row for row, seq in enumerate(pending[0].seqs)}
                num_read += len(placeholders)
                for row in placeholders:
                    token_ids[row] = pending[1][previous_row[batch.seqs[row].seq_id]]
            object.__setattr__(desc, "token_ids", token_ids)
            sampled = device.step(desc)
        if pending is not None:
            scheduler.apply(*pending)
        if batch is not None:
            scheduler.commit(batch)
        scheduler.check_integrity()
        pending = (batch, sampled) if batch is not None else None
        if pending is None and not scheduler.has_unfinished():
            return num_read
    raise AssertionError("not done")


def workload(scheduler: Scheduler, rng: np.random.Generator, count: int) -> list:
    shared = rng.integers(0, 50, 24).tolist()
    seqs = []
    for i in range(count):
        prompt = shared[: rng.integers(1, 24)] + rng.integers(0, 50, rng.integers(1, 12)).tolist()
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 12)),
            min_tokens=int(rng.integers(0, 2)),
            stop_token_ids=[int(t) for t in rng.integers(0, 50, 3)],
            ignore_eos=bool(i % 2),
        )
        seqs.append(scheduler.add(prompt, params))
    return seqs


@pytest.mark.parametrize("num_blocks", [64, 12], ids=["roomy", "preempting"])
@pytest.mark.parametrize("seed", range(4))
def test_async_equals_sync(num_blocks, seed):
    config = dict(num_blocks=num_blocks, eos_token_ids=(3,), max_num_batched_tokens=16)
    sync, pipelined = Scheduler(make_config(**config)), Scheduler(make_config(**config))
    sync_seqs = workload(sync, np.random.default_rng(seed), 20)
    async_seqs = workload(pipelined, np.random.default_rng(seed), 20)

    Harness(sync).run()
    assert run_async(pipelined) > 0

    reasons = {seq.finish_reason for seq in sync_seqs}
    assert reasons == {"stop", "length"}, "the workload should end requests both ways"
    for expected, actual in zip(sync_seqs, async_seqs, strict=True):
        assert actual.output_token_ids == expected.output_token_ids, actual
        assert actual.finish_reason == expected.finish_reason, actual
        assert PLACEHOLDER not in actual.output_token_ids
    assert pipelined.block_pool.num_free_blocks == num_blocks
    if num_blocks == 12:
        assert pipelined.num_preemptions > 0
