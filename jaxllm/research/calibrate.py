"""Steps of the real engine, timed: samples to fit a `StepCostModel`, and a timed trace replayed
through the engine to compare its times to first token with the simulator's
(`scripts/calibrate_step_cost.py`, docs/cache-policies.md).

The engine plans step N + 1 while the device runs step N: call c of `Engine.step` dispatches
plan c and waits for plan c - 1's tokens. So the time of plan c - 1 is taken from the end of
call c - 1 to the end of call c; for a plan made with nothing in flight, from the start of its
own call (the host's planning and dispatch, which nothing hid). The sum of a busy stretch's
samples is then its wall time, and a request's first token arrives at the end of the sample of
the plan that sampled it: the clock `cache_sim.simulate` keeps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxllm.research.cost_model import StepCostModel, StepWork, step_work
from jaxllm.research.workloads import Request
from jaxllm.sched import SchedulerConfig, StepPlan


class PlanLog:
    """Records every plan (None included) that a scheduler's `schedule` returns, while in a
    `with` block.

    NOTE: the engine reports no per-step plan; the log wraps the scheduler's `schedule` for the
    block (an attribute of the instance, deleted on exit) and changes nothing it returns.
    """

    def __init__(self, scheduler) -> None:
        self.plans: list[StepPlan | None] = []
        self._scheduler = scheduler

    def __enter__(self) -> PlanLog:
        schedule = self._scheduler.schedule

        def logged() -> StepPlan | None:
            plan = schedule()
            self.plans.append(plan)
            return plan

        self._scheduler.schedule = logged
        return self

    def __exit__(self, *exc_info) -> None:
        del self._scheduler.schedule


@dataclass
class TimedRun:
    """One run of requests through the engine.

    Attributes:
        samples: (work of the plan, seconds) for every plan, in order.
        ttft_seconds: [num_requests] from each request's arrival (its `arrival_time` after the
            run's start; None: the start) to its first token, in the requests' order.
        wall_seconds: the run's duration.
    """

    samples: list[tuple[StepWork, float]]
    ttft_seconds: np.ndarray
    wall_seconds: float


def run_timed(engine, requests: Sequence[Request]) -> TimedRun:
    """Runs `requests` to completion through `engine` (a `jaxllm.engine.Engine`; ignore_eos,
    greedy), adding each when its arrival time comes and stepping the engine meanwhile.

    Mutates: the engine's scheduler (queues, prefix cache) and KV cache.
    """
    from jaxllm import SamplingParams

    arrivals = [request.arrival_time or 0.0 for request in requests]
    order = sorted(range(len(requests)), key=arrivals.__getitem__)
    index_of: dict[int, int] = {}
    first_token_at = np.full(len(requests), np.nan)
    samples: list[tuple[StepWork, float]] = []
    in_flight: tuple[StepPlan, bool, float] | None = None  # plan, from idle, timed since
    next_index = 0
    with PlanLog(engine.scheduler) as log:
        start = time.perf_counter()
        while next_index < len(order) or engine.has_unfinished():
            now = time.perf_counter() - start
            while next_index < len(order) and arrivals[order[next_index]] <= now:
                request = requests[order[next_index]]
                params = SamplingParams(
                    temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True
                )
                record = engine.new_request(request.prompt_token_ids.tolist(), params)
                engine.add(record)
                index_of[record.request_id] = order[next_index]
                next_index += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, arrivals[order[next_index]] - (time.perf_counter() - start)))
                continue
            call_start = time.perf_counter()
            outputs = engine.step()
            call_end = time.perf_counter()
            for output in outputs:
                first_token_at[index_of[output.request_id]] = output.metrics.first_token_time
            if in_flight is not None:  # this call waited for its tokens
                previous, previous_from_idle, since = in_flight
                samples.append((step_work(previous, previous_from_idle), call_end - since))
            plan = log.plans[-1]  # what this call dispatched
            from_idle = in_flight is None
            in_flight = (
                None if plan is None else (plan, from_idle, call_start if from_idle else call_end)
            )
        wall = time.perf_counter() - start
    ttft = first_token_at - start - np.array(arrivals)
    return TimedRun(samples, ttft, wall)


def calibration_phases(
    config: SchedulerConfig,
    *,
    decode_steps: int = 32,
    repeats: int = 3,
    vocab_size: int = 10_000,
    seed: int = 0,
) -> list[list[Request]]:
    """Groups of requests, each run to completion after the one before, whose steps span the
    shapes the engine runs under `config` (within its cache and max_model_len):

    - prefill of every bucket size T of the ladder (prompts of T - 1 tokens, or several that
      fill T), `repeats` times, from an idle engine, and a stream of full prefill steps;
    - the same after a cached prefix, so that the new tokens attend to many more;
    - decode batches of every power of two up to max_num_seqs at a few context lengths, for
      `decode_steps` steps each.
    """
    rng = np.random.default_rng(seed)
    tile, budget = config.prefill_tile, config.max_num_batched_tokens
    longest = config.max_model_len - decode_steps - 1  # the longest prompt of a phase
    capacity = config.num_blocks * config.block_size * 4 // 5

    def prompts(count: int, length: int, prefix: np.ndarray | None = None) -> list[np.ndarray]:
        own = [rng.integers(0, vocab_size, length, dtype=np.int32) for _ in range(count)]
        return own if prefix is None else [np.concatenate([prefix, p]) for p in own]

    sizes = [tile << k for k in range(32) if tile << k <= budget]
    if longest < tile:
        raise ValueError(
            f"max_model_len {config.max_model_len} leaves no room for a prompt of one prefill "
            f"tile ({tile}) and {decode_steps} decode steps"
        )
    prompt_size = max(size for size in sizes if size <= longest)  # prompts of many tiles
    phases: list[list[Request]] = []
    for size in sizes:
        count = max(1, size // prompt_size)
        for _ in range(repeats):
            phases.append([Request(p, 1) for p in prompts(count, min(size, prompt_size) - 1)])
    stream = 4 * max(1, budget // prompt_size)
    phases.append([Request(p, 1) for p in prompts(stream, prompt_size - 1)])
    prefix_len = (longest // 2) // config.block_size * config.block_size
    if prefix_len:
        prefix = prompts(1, prefix_len)[0]
        phases.append([Request(np.concatenate([prefix, prompts(1, 1)[0]]), 1)])
        for size in sizes:
            if prefix_len + size - 1 <= longest:
                phases.append([Request(p, 1) for p in prompts(repeats, size - 1, prefix)])
    contexts = sorted({tile, max(tile, longest // 4), longest})
    batch = 1
    while batch <= config.max_num_seqs:
        for context in contexts:
            if batch * (context + decode_steps) <= capacity:
                phases.append([Request(p, decode_steps) for p in prompts(batch, context)])
        batch = min(2 * batch, config.max_num_seqs) if batch < config.max_num_seqs else batch + 1
    return phases


def warm_up(engine, **phase_options) -> None:
    """Runs `calibration_phases` once (prompts of another seed), untimed, so that compilation
    and first-run costs stay out of what is timed next."""
    for phase in calibration_phases(engine.scheduler.config, **phase_options | {"seed": 1}):
        run_timed(engine, phase)


def measure(engine, **phase_options) -> list[tuple[StepWork, float]]:
    """(work, seconds) of every step of `calibration_phases` (after `warm_up`), run on `engine`
    one phase after the other."""
    warm_up(engine, **phase_options)
    samples = []
    for phase in calibration_phases(engine.scheduler.config, **phase_options):
        samples += run_timed(engine, phase).samples
    return samples


def fit_report(model: StepCostModel, samples: list[tuple[StepWork, float]]) -> dict:
    """How well `model` predicts `samples`: mean and largest relative error, and the measured
    and predicted total seconds, of all steps, of prefill and decode steps, of plans of several
    decode steps, and of steps planned from idle."""
    report = {}
    kinds = {
        "all": lambda work: True,
        "prefill": lambda work: work.num_prefill_tokens > 0,
        "decode": lambda work: work.num_decode_rows > 0,
        "multi_step_decode": lambda work: work.num_forward_steps > 1,
        "from_idle": lambda work: work.from_idle > 0,
    }
    for kind, chosen in kinds.items():
        pairs = [(model.step_seconds(work), seconds) for work, seconds in samples if chosen(work)]
        if not pairs:
            continue
        predicted, measured = np.array(pairs).T
        errors = np.abs(predicted - measured) / measured
        report[kind] = {
            "steps": len(pairs),
            "mean_relative_error": float(errors.mean()),
            "max_relative_error": float(errors.max()),
            "measured_seconds": float(measured.sum()),
            "predicted_seconds": float(predicted.sum()),
        }
    return report


def latency_summary(seconds: np.ndarray) -> dict[str, float]:
    """Mean, p50 and p99 of some latencies, in seconds."""
    p50, p99 = np.percentile(seconds, [50, 99]).tolist()
    return {"mean": float(np.mean(seconds)), "p50": p50, "p99": p99}


def replay(engine, requests: Sequence[Request], model: StepCostModel) -> dict:
    """Runs a timed trace through `engine` (from an empty prefix cache) and through the simulator
    with `model` and the engine's scheduler settings; returns both TTFT summaries (seconds),
    their ratios (simulator over engine), the prefix-cache hit tokens and steps of each, and
    the engine's compilations during the run (0 unless some bucket was compiled lazily).

    Mutates: resets the engine (`Engine.reset`), then runs the requests on it.
    """
    from jaxllm.research.cache_sim import simulate

    engine.reset()
    before = engine.scheduler.stats()
    compiled_before = engine.runner.num_executables
    run = run_timed(engine, requests)
    policy = engine.config.eviction_policy
    policy = policy if isinstance(policy, str) else type(policy)()
    simulated = simulate(
        requests, engine.scheduler.config, policy, arrival="time", cost_model=model
    )
    measured, predicted = latency_summary(run.ttft_seconds), latency_summary(simulated.ttft_seconds)
    return {
        "num_requests": len(requests),
        "engine_ttft_seconds": measured,
        "simulator_ttft_seconds": predicted,
        "ttft_ratio": {key: predicted[key] / measured[key] for key in measured},
        "engine_wall_seconds": run.wall_seconds,
        "simulated_seconds": simulated.simulated_seconds,
        "engine_hit_tokens": engine.scheduler.stats().num_hit_tokens - before.num_hit_tokens,
        "simulator_hit_tokens": simulated.num_hit_tokens,
        "engine_steps": len(run.samples),
        "engine_steps_fit": fit_report(model, run.samples),
        # NOTE: a step that compiles takes far longer than its model says.
        "compilations_during_replay": engine.runner.num_executables - compiled_before,
        "simulator_steps": simulated.num_prefill_steps + simulated.num_decode_steps,
        "cost_model": model.as_dict(),
    }
