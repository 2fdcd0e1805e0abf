"""The step cost model: the work of a plan, the fit (NNLS), JSON; and the simulator's clock driven
by it, worked out by hand (pure Python + numpy, no model)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from support.repo import assert_import_leaves_out

from jaxllm.research import workloads as w
from jaxllm.research.cache_sim import make_config, simulate
from jaxllm.research.cost_model import (
    H200_QWEN3_0_6B,
    StepCostModel,
    StepWork,
    nnls,
    step_work,
)
from jaxllm.research.sim_report import format_table, latency_cdf, write_csv, write_json
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, SchedulerConfig

BLOCK = 16
TRUE = StepCostModel(StepWork(1.7e-3, 9e-4, 2.3e-6, 8e-10, 4.5e-6, 1.3e-8))


def random_work(rng: np.random.Generator, count: int) -> list[StepWork]:
    """Prefill and decode steps of random sizes, some plans of 4 decode steps, some from idle."""
    works = []
    for _ in range(count):
        idle = int(rng.random() < 0.3)
        if rng.random() < 0.5:
            tokens = int(rng.choice([128, 256, 1024, 4096, 16384]))
            pairs = int(rng.integers(tokens, tokens * 3000))
            works.append(StepWork(1, idle, tokens, pairs, 0, 0))
        else:
            steps = int(rng.choice([1, 4]))
            rows = int(rng.choice([1, 8, 64, 512]))
            context = int(rng.integers(1, 4096))
            works.append(StepWork(steps, idle, 0, 0, rows * steps, rows * steps * context))
    return works


# The fit.


def test_fit_recovers_known_prices():
    works = random_work(np.random.default_rng(0), 200)
    samples = [(work, TRUE.step_seconds(work)) for work in works]
    fitted = StepCostModel.fit(samples, description="synthetic")
    np.testing.assert_allclose(fitted.prices, TRUE.prices, rtol=1e-6)
    assert fitted.description == "synthetic"


def test_fit_keeps_prices_non_negative_and_zeroes_unused_ones():
    # Steps whose time falls with their size: least squares would give a negative slope.
    samples = [(StepWork(1, 0, tokens, 0, 0, 0), 0.01 - 1e-6 * tokens) for tokens in (128, 4096)]
    samples += [(StepWork(1, 0, 0, 0, 8, 800), 0.01)]
    fitted = StepCostModel.fit(samples)
    assert fitted.prices.num_prefill_tokens == 0.0
    assert fitted.prices.num_forward_steps > 0
    assert fitted.prices.from_idle == fitted.prices.num_prefill_pairs == 0.0  # no such work
    assert all(price >= 0 for price in fitted.prices)
    with pytest.raises(ValueError, match="more than 0"):
        StepCostModel.fit([(StepWork(), 0.0)])
    with pytest.raises(ValueError, match="at least one"):
        StepCostModel.fit([])


def brute_force_nnls(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The best least-squares solution over every set of columns whose solution is >= 0."""
    best, best_residual = np.zeros(matrix.shape[1]), np.linalg.norm(target)
    for size in range(1, matrix.shape[1] + 1):
        for columns in itertools.combinations(range(matrix.shape[1]), size):
            solution = np.linalg.lstsq(matrix[:, columns], target, rcond=None)[0]
            if (solution < 0).any():
                continue
            x = np.zeros(matrix.shape[1])
            x[list(columns)] = solution
            residual = np.linalg.norm(matrix @ x - target)
            if residual < best_residual - 1e-12:
                best, best_residual = x, residual
    return best


@pytest.mark.parametrize("seed", range(20))
def test_nnls_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    matrix = rng.normal(size=(12, 4))
    target = rng.normal(size=12)
    expected = brute_force_nnls(matrix, target)
    np.testing.assert_allclose(nnls(matrix, target), expected, atol=1e-9)


def test_json_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    H200_QWEN3_0_6B.save(path)
    assert StepCostModel.load(path) == H200_QWEN3_0_6B
    record = json.loads(path.read_text())
    prices = dict(record["prices"])
    assert set(prices) == set(StepWork._fields)
    record["prices"]["num_bananas"] = 1.0
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="num_bananas"):
        StepCostModel.load(path)
    del record["prices"]["num_bananas"], record["prices"]["from_idle"]
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="from_idle"):
        StepCostModel.load(path)
    for price in (-1.0, "0.1", None, True):
        path.write_text(
            json.dumps(H200_QWEN3_0_6B.as_dict() | {"prices": prices | {"from_idle": price}})
        )
        with pytest.raises(ValueError, match=r"price from_idle must be a finite number >= 0"):
            StepCostModel.load(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="is not a step cost model"):
        StepCostModel.load(path)


# The work of a plan.


def test_step_work_of_prefill_and_decode_plans():
    config = SchedulerConfig(
        num_blocks=16, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=64, prefill_tile=16,
    )  # fmt: skip
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for length in (20, 5):
        scheduler.add(scheduler.new_sequence(np.arange(length) + 100 * length, params))
    prefill = scheduler.schedule()
    # 20 + 5 tokens, each chunk padded to whole tiles: 32 + 16 = 48, in the bucket of 64.
    assert step_work(prefill, from_idle=True) == StepWork(1, 1, 64, 20 * 21 // 2 + 5 * 6 // 2, 0, 0)
    scheduler.update(prefill, np.zeros(4, np.int32))
    decode = scheduler.schedule()
    # Positions 20 and 5 are computed: contexts of 21 and 6 tokens, in the bucket of 2 rows.
    assert step_work(decode) == StepWork(1, 0, 0, 0, 2, 21 + 6)


def test_step_work_of_a_plan_of_several_decode_steps():
    config = SchedulerConfig(
        num_blocks=16, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=64, prefill_tile=16, num_scheduler_steps=4,
    )  # fmt: skip
    scheduler = Scheduler(config)
    scheduler.add(scheduler.new_sequence(np.arange(10), SamplingParams(max_tokens=3)))
    scheduler.add(scheduler.new_sequence(np.arange(7) + 50, SamplingParams(max_tokens=8)))
    prefill = scheduler.schedule()
    scheduler.update(prefill, np.zeros(4, np.int32))
    decode = scheduler.schedule()
    assert decode.bucket.num_steps == 4 and decode.num_new_tokens == [2, 4]
    # Sequence 0 computes positions 10, 11 (contexts 11, 12); sequence 1 positions 7 .. 10; 4
    # rows (the smallest multi-step bucket here) computed 4 times.
    assert step_work(decode) == StepWork(4, 0, 0, 0, 4 * 4, 11 + 12 + 8 + 9 + 10 + 11)


# The simulator's clock.

HAND = StepCostModel(
    StepWork(
        num_forward_steps=1.0,
        from_idle=0.5,
        num_prefill_tokens=0.01,
        num_prefill_pairs=0.0001,
        num_decode_rows=0.1,
        num_context_tokens=0.001,
    )
)


def hand_workload() -> tuple[list[w.Request], SchedulerConfig]:
    """A: 16 tokens, 3 to generate, at 0 s; B: 8 tokens, 2 to generate, at 2 s."""
    rng = np.random.default_rng(0)
    requests = [
        w.Request(rng.integers(0, 1000, 16, dtype=np.int32), 3, 0.0),
        w.Request(rng.integers(0, 1000, 8, dtype=np.int32), 2, 2.0),
    ]
    config = make_config(
        requests, 16, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=64, prefill_tile=16
    )
    return requests, config


def test_the_clock_advances_by_each_steps_modelled_seconds():
    requests, config = hand_workload()
    result = simulate(requests, config, arrival="time", cost_model=HAND)
    # Step 1 (from idle, at 0): prefill A, a bucket of 16 tokens, 16 * 17 / 2 pairs.
    end1 = 1.0 + 0.5 + 0.01 * 16 + 0.0001 * 136
    # Step 2 (planned at 0, while step 1 runs): decode A at position 16 (context 17).
    end2 = end1 + 1.0 + 0.1 * 1 + 0.001 * 17
    # Step 3 (planned at end1, before B arrives at 2 s): decode A's last token (context 18).
    end3 = end2 + 1.0 + 0.1 * 1 + 0.001 * 18
    # Step 4 (planned at end2 > 2 s): prefill B, a bucket of 16 tokens, 8 * 9 / 2 pairs.
    end4 = end3 + 1.0 + 0.01 * 16 + 0.0001 * 36
    # Step 5: decode B's last token at position 8 (context 9).
    end5 = end4 + 1.0 + 0.1 * 1 + 0.001 * 9
    assert end1 < 2.0 < end2
    assert result.num_prefill_steps == 2 and result.num_decode_steps == 3
    assert result.simulated_seconds == pytest.approx(end5, rel=1e-12)
    np.testing.assert_allclose(result.ttft_seconds, [end1, end4 - 2.0], rtol=1e-12)
    np.testing.assert_allclose(result.queueing_seconds, [0.0, end3 - 2.0], rtol=1e-12)
    assert result.mean_ttft_seconds == pytest.approx((end1 + end4 - 2.0) / 2, rel=1e-12)
    assert result.p50_ttft_seconds == pytest.approx((end1 + end4 - 2.0) / 2, rel=1e-12)
    assert result.p99_ttft_seconds == pytest.approx(end1 + 0.99 * (end4 - 2.0 - end1), rel=1e-12)
    assert result.output_tokens_per_second == pytest.approx(5 / end5, rel=1e-12)
    assert result.mean_ttft_steps == 1


def test_overhead_alone_is_the_fixed_step_time():
    requests = w.with_poisson_arrivals(w.shared_prefix(4, 4, 40, 8, 6, seed=0), 3.0, seed=1)
    config = make_config(requests, 64, block_size=BLOCK, max_num_seqs=4, prefill_tile=16)
    fixed = simulate(requests, config, arrival="time", step_time=0.25)
    modelled = simulate(
        requests, config, arrival="time", cost_model=StepCostModel(StepWork(num_forward_steps=0.25))
    )
    assert modelled.simulated_seconds == pytest.approx(fixed.simulated_seconds, rel=1e-12)
    np.testing.assert_allclose(modelled.ttft_seconds, fixed.ttft_seconds, rtol=1e-12)
    assert (fixed.ttft_seconds >= 0.25 - 1e-12).all()  # at least the step that samples it
    assert fixed.num_hit_tokens == modelled.num_hit_tokens > 0
    with pytest.raises(ValueError, match="not both"):
        simulate(requests, config, step_time=1.0, cost_model=HAND)


def test_timed_reports(tmp_path):
    requests, config = hand_workload()
    timed = simulate(requests, config, arrival="time", cost_model=HAND)
    untimed = simulate(requests, config)
    assert untimed.simulated_seconds == 0 and (untimed.ttft_seconds == 0).all()
    assert "out tok/s" in format_table([timed, untimed])
    assert "out tok/s" not in format_table([untimed])
    write_csv([timed], tmp_path / "out.csv")
    assert "mean_ttft_seconds" in (tmp_path / "out.csv").read_text().splitlines()[0]
    write_json([timed], tmp_path / "out.json", per_request=True, workload="hand")
    record = json.loads((tmp_path / "out.json").read_text())
    assert record["workload"] == "hand"
    assert record["results"][0]["ttft_seconds"] == timed.ttft_seconds.tolist()
    assert "ttft_seconds" not in timed.as_dict()
    seconds, fractions = latency_cdf(np.array([3.0, 1.0, 2.0, 2.0]))
    assert seconds.tolist() == [1.0, 2.0, 2.0, 3.0] and fractions.tolist() == [0.25, 0.5, 0.75, 1]


def test_cost_model_imports_no_jax():
    assert_import_leaves_out("jaxllm.research.cost_model, jaxllm.research.cache_sim", {"jax"})


def test_plans_of_several_decode_steps_run_to_the_end():
    # 16 prompt tokens, 9 to generate, plans of 4 decode steps: a prefill (token 1), then two
    # plans of 4 steps (tokens 2 - 5 and 6 - 9).
    request = w.Request(np.arange(16, dtype=np.int32), 9, 0.0)
    config = make_config([request], block_size=BLOCK, max_num_seqs=4, prefill_tile=16)
    config = dataclasses.replace(config, num_scheduler_steps=4)
    result = simulate([request], config, arrival="time", cost_model=HAND)
    assert result.num_prefill_steps == 1 and result.num_decode_steps == 2
    prefill = 1.0 + 0.5 + 0.01 * 16 + 0.0001 * 136
    # 4 steps of one row padded to 4 (the smallest multi-step bucket here); contexts 17 - 20,
    # then 21 - 24.
    decodes = 2 * (4 * 1.0 + 0.1 * 4 * 4) + 0.001 * (sum(range(17, 21)) + sum(range(21, 25)))
    assert result.simulated_seconds == pytest.approx(prefill + decodes, rel=1e-12)
    assert result.ttft_seconds.tolist() == pytest.approx([prefill], rel=1e-12)
