"""Planning one step ahead, as the engine does: step N is planned and run before step N - 1's
tokens are applied, its decode rows taking the tokens still on the device from step N - 1's
output (the runner's `previous_rows`). The outputs must equal the synchronous loop's."""

from __future__ import annotations

import numpy as np
import pytest
from support.sched import FakeDevice, Harness, make_config

from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler
from jaxllm.steps import previous_rows


def run_async(scheduler: Scheduler, max_steps: int = 2000) -> tuple[int, int]:
    """The engine's loop over the fake device: plan and run step N, then update step N - 1.
    Returns how many input tokens were taken from the previous step's output, and how many
    plans ran several decode steps."""
    device = FakeDevice(scheduler.config.num_blocks, scheduler.config.block_size)
    pending = None
    num_read = num_multi_step = 0
    for _ in range(max_steps):
        plan = scheduler.schedule()
        sampled = None
        if plan is not None:
            rows = previous_rows(plan, pending[0] if pending else None)
            token_ids = plan.inputs.token_ids.copy()
            taken = np.flatnonzero(rows >= 0)
            if len(taken):
                previous = pending[1] if pending[1].ndim == 1 else pending[1][-1]  # the last step's
                token_ids[taken] = previous[rows[taken]]
            num_read += int(np.count_nonzero(plan.inputs.token_ids[taken] == 0))
            sampled = device.step(plan, token_ids)
            num_multi_step += plan.bucket.num_steps > 1
        if pending is not None:
            scheduler.update(*pending)
        scheduler.check_integrity()
        pending = (plan, sampled) if plan is not None else None
        if pending is None and not scheduler.has_unfinished():
            return num_read, num_multi_step
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
        seqs.append(scheduler.new_sequence(prompt, params))
        scheduler.add(seqs[-1])
    return seqs


@pytest.mark.parametrize("num_steps", [1, 3], ids=["one-step", "three-step-plans"])
@pytest.mark.parametrize("num_blocks", [64, 12], ids=["roomy", "preempting"])
@pytest.mark.parametrize("seed", range(4))
def test_async_equals_sync(num_blocks, seed, num_steps):
    """Also with decode plans of three steps against the synchronous loop of one."""
    config = dict(num_blocks=num_blocks, eos_token_ids=(3,), max_num_batched_tokens=16)
    sync = Scheduler(make_config(**config))
    pipelined = Scheduler(make_config(**config, num_scheduler_steps=num_steps))
    sync_seqs = workload(sync, np.random.default_rng(seed), 20)
    async_seqs = workload(pipelined, np.random.default_rng(seed), 20)

    Harness(sync).run()
    num_read, num_multi_step = run_async(pipelined)
    assert num_read > 0
    assert num_multi_step == 0 if num_steps == 1 else num_blocks == 12 or num_multi_step > 0

    reasons = {seq.finish_reason for seq in sync_seqs}
    assert reasons == {"stop", "length"}, "the workload should end requests both ways"
    for expected, actual in zip(sync_seqs, async_seqs, strict=True):
        assert actual.output_token_ids == expected.output_token_ids, actual
        assert actual.finish_reason == expected.finish_reason, actual
    assert pipelined.block_pool.num_free_blocks == num_blocks
    if num_blocks == 12:
        assert pipelined.num_preemptions > 0
