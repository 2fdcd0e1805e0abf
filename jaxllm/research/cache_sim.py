"""The prefix-cache simulator: a workload through the real `Scheduler` and `BlockPool`, no model.

The step loop is the engine's (`Engine.step`): plan step N, then update step N - 1 with its
tokens; so with the engine's `SchedulerConfig` the simulator admits, evicts and preempts exactly
as the engine does and reports the same `CacheStats` (tests/research/test_cache_sim_vs_engine.py).
Requests run with ignore_eos, so each makes its max_tokens (what max_model_len leaves). The
sampled tokens are synthetic: always `SYNTHETIC_TOKEN`, so, as under greedy decoding, identical
prompts produce identical outputs (and share their output blocks) and different prompts never
do.

A simulated clock (a fixed `step_time`, or a `cost_model.StepCostModel` pricing each step's
work) gives times to first token and queueing delays in seconds.

Pure Python + numpy: no jax import. A run costs a few microseconds per
running sequence per step, plus the hashing of each prompt's blocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxllm.cache.eviction import POLICIES, EvictionPolicy
from jaxllm.research.cost_model import StepCostModel
from jaxllm.research.sim_report import format_table, plot, write_csv, write_json
from jaxllm.research.workloads import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, SchedulerConfig

__all__ = [
    "POLICY_NAMES",
    "SimResult",
    "blocks_for_all",
    "default_cache_sizes",
    "format_table",
    "make_config",
    "plot",
    "simulate",
    "sweep",
    "write_csv",
    "write_json",
]

SYNTHETIC_TOKEN = 0
POLICY_NAMES = tuple(POLICIES)


@dataclass(frozen=True)
class SimResult:
    """What one simulated run did.

    Attributes:
        policy: the eviction policy's name.
        num_blocks, block_size: the KV cache.
        enable_prefix_caching: whether the prefix cache was on.
        num_requests: requests in the workload.
        num_prompt_tokens, num_output_tokens: their totals.
        num_queried_tokens: tokens looked up at admission (re-admissions after a preemption
            included: `CacheStats.num_queried_tokens`).
        num_hit_tokens: of those, tokens served from the prefix cache: the prefill saved.
        num_prompt_hit_tokens: tokens served from the cache at each request's first admission
            (the sum of `RequestOutput.num_cached_tokens`): what the cache saved on new
            prompts, leaving out the recomputation of preempted requests.
        num_prefill_tokens: tokens the prefill steps computed (recomputation included).
        num_evictions: cached blocks evicted.
        num_preemptions: running sequences preempted for lack of blocks.
        num_prefill_steps, num_decode_steps: steps of each kind.
        mean_ttft_steps: mean steps from a request's arrival (the first step planned at or
            after it) to the step that sampled its first token, that step included.
        simulated_seconds: the simulated clock at the end: every step's seconds (`step_time`
            or the cost model's), plus idle time waiting for arrivals; 0 without either.
        mean_ttft_seconds, p50_ttft_seconds, p99_ttft_seconds: time to first token, from the
            request's arrival to the end of the step that sampled its first token.
        mean_queueing_seconds, p50_queueing_seconds, p99_queueing_seconds: from the request's
            arrival to the start of the first step that scheduled it.
        output_tokens_per_second: output tokens over `simulated_seconds`; 0 without a clock.
        wall_seconds: how long the simulation took on this machine.
        hit_rate: hit tokens over queried tokens (the pool's own `CacheStats.hit_rate`).
        ttft_seconds, queueing_seconds: [num_requests] each request's, in the workload's order
            (not in `as_dict`; `sim_report.write_json(..., per_request=True)` writes them).
    """

    policy: str
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_prompt_hit_tokens: int
    num_prefill_tokens: int
    num_evictions: int
    num_preemptions: int
    num_prefill_steps: int
    num_decode_steps: int
    mean_ttft_steps: float
    simulated_seconds: float
    mean_ttft_seconds: float
    p50_ttft_seconds: float
    p99_ttft_seconds: float
    mean_queueing_seconds: float
    p50_queueing_seconds: float
    p99_queueing_seconds: float
    output_tokens_per_second: float
    wall_seconds: float
    hit_rate: float
    ttft_seconds: np.ndarray = field(repr=False, compare=False)
    queueing_seconds: np.ndarray = field(repr=False, compare=False)

    @property
    def prompt_hit_rate(self) -> float:
        """Prompt tokens served from the cache at first admission over all prompt tokens."""
        return (
            self.num_prompt_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
        )

    def as_dict(self) -> dict:
        """The scalars (per-request arrays left out), and `prompt_hit_rate`."""
        scalars = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("ttft_seconds", "queueing_seconds")
        }
        return scalars | {"prompt_hit_rate": self.prompt_hit_rate}


def blocks_for_all(requests: Iterable[Request], block_size: int) -> int:
    """KV blocks that hold every request of a workload at once: a cache that never evicts."""
    return sum(-(-(r.num_prompt_tokens + r.max_tokens) // block_size) for r in requests)


def default_cache_sizes(requests: Sequence[Request], block_size: int) -> list[int]:
    """Powers of two from the smallest cache that holds the longest request to the first that
    holds the whole workload."""
    smallest = max(-(-(r.num_prompt_tokens + r.max_tokens) // block_size) for r in requests)
    largest = blocks_for_all(requests, block_size)
    size = 1 << (smallest - 1).bit_length()
    sizes = [size]
    while size < largest:
        size *= 2
        sizes.append(size)
    return sizes


def make_config(
    requests: Sequence[Request],
    num_blocks: int | None = None,
    *,
    block_size: int = 256,
    max_num_seqs: int = 512,
    max_num_batched_tokens: int = 16384,
    prefill_tile: int = 128,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
) -> SchedulerConfig:
    """A scheduler config for a workload; the defaults are the engine's on a GPU.

    Args:
        num_blocks: None: `blocks_for_all(requests)`, a cache that never evicts.
        max_model_len: None: the longest request (prompt plus max_tokens), so none is cut.
    """
    if max_model_len is None:
        max_model_len = max(2, max(r.num_prompt_tokens + r.max_tokens for r in requests))
    return SchedulerConfig(
        num_blocks=blocks_for_all(requests, block_size) if num_blocks is None else num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        prefill_tile=prefill_tile,
        enable_prefix_caching=enable_prefix_caching,
    )


def simulate(
    requests: Sequence[Request],
    config: SchedulerConfig,
    policy: str | EvictionPolicy = "lru",
    *,
    arrival: str = "order",
    step_time: float = 0.0,
    cost_model: StepCostModel | None = None,
    check_integrity: bool = False,
) -> SimResult:
    """Replays `requests` through a fresh `Scheduler(config, eviction_policy=policy)`.

    The clock follows the engine, which plans step N + 1 while the device runs step N: a plan
    is made when the step in flight starts (at once when none is), and each step starts when
    the one before it ends.

    Args:
        arrival: "order": every request is added before the first step, in list order (what
            `LLM.generate` does); "time": each is added before the first plan made at or after
            its `arrival_time` (None counts as 0), the clock jumping ahead when nothing is left
            to run.
        step_time: seconds per step (prefill or decode), when there is no cost model.
        cost_model: the seconds of each step from the work of its plan
            (`StepCostModel.plan_seconds`).
        check_integrity: check the scheduler's and the pool's invariants after every step
            (slow; for tests).

    Raises:
        ValueError: a request the scheduler refuses (too long for max_model_len or the cache),
            or both a step time and a cost model.
    """
    if arrival not in ("order", "time"):
        raise ValueError(f"arrival must be 'order' or 'time', got {arrival!r}")
    if cost_model is not None and step_time:
        raise ValueError("give a step_time or a cost_model, not both")
    start_wall = time.perf_counter()
    now = 0.0  # when the current plan is made: the time policies see
    scheduler = Scheduler(config, eviction_policy=policy, clock=lambda: now, outlines=True)
    params_of: dict[int, SamplingParams] = {}
    arrivals = [0.0 if arrival == "order" else (r.arrival_time or 0.0) for r in requests]
    order = sorted(range(len(requests)), key=arrivals.__getitem__)
    # [K, S]: a token for each row at each step of a plan of K decode steps (one step: row 0).
    shape = (config.num_scheduler_steps, max(config.max_num_seqs, 1))
    tokens = np.full(shape, SYNTHETIC_TOKEN, dtype=np.int32)
    seqs = []
    # NOTE: an offline policy (`belady.BeladyPolicy`) learns the run it replays.
    bind_run = getattr(scheduler.block_pool.policy, "bind_run", None)
    if bind_run is not None:
        bind_run(scheduler.block_pool, seqs)
    index_of: dict[int, int] = {}  # seq_id -> the request's index in `requests`
    arrival_step = [0] * len(requests)  # the steps planned before the request was added
    scheduled_at: list[float | None] = [None] * len(requests)  # start of its first step
    first_token_at: list[float | None] = [None] * len(requests)  # end of its first token's step
    ttft_steps_total = 0
    num_prefill_tokens = num_prefill_steps = num_decode_steps = 0
    clock = 0.0  # when the steps planned so far end
    in_flight_start = 0.0  # when the step in flight started
    step = 0
    next_index = 0
    in_flight = None
    while next_index < len(order) or scheduler.has_unfinished() or in_flight is not None:
        now = clock if in_flight is None else in_flight_start  # when this plan is made
        if (
            next_index < len(order)
            and not scheduler.has_unfinished()
            and in_flight is None
            and arrivals[order[next_index]] > clock
        ):
            clock = now = arrivals[order[next_index]]
        while next_index < len(order) and arrivals[order[next_index]] <= now:
            index = order[next_index]
            request = requests[index]
            params = params_of.get(request.max_tokens)
            if request.metadata is not None:
                params = SamplingParams(
                    max_tokens=request.max_tokens, ignore_eos=True, extra_args=request.metadata
                )
            elif params is None:
                params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
                params_of[request.max_tokens] = params
            seq = scheduler.new_sequence(request.prompt_token_ids, params)
            scheduler.add(seq)
            seqs.append(seq)
            index_of[seq.seq_id] = index
            arrival_step[index] = step
            next_index += 1
        plan = scheduler.schedule()
        from_idle = in_flight is None
        if in_flight is not None:
            scheduler.update(in_flight, tokens)
        in_flight = plan
        if plan is None:
            continue
        step += 1
        in_flight_start = clock
        clock += step_time if cost_model is None else cost_model.plan_seconds(plan, from_idle)
        if plan.is_prefill:
            num_prefill_steps += 1
            num_prefill_tokens += plan.num_tokens
            for seq, samples in zip(plan.seqs, plan.samples, strict=True):
                index = index_of[seq.seq_id]
                if scheduled_at[index] is None:
                    scheduled_at[index] = in_flight_start
                if samples and first_token_at[index] is None:
                    first_token_at[index] = clock
                    ttft_steps_total += step - arrival_step[index]
        else:
            num_decode_steps += 1
        if check_integrity:
            scheduler.check_integrity()
    stats = scheduler.stats()
    if isinstance(policy, str):
        name = policy
    else:  # NOTE: a subclass without a name of its own goes by its class, not its base's name
        name = vars(type(policy)).get("name") or type(policy).__name__
    arrived = np.array(arrivals, dtype=np.float64)
    ttft = np.array(first_token_at, dtype=np.float64) - arrived
    queueing = np.array(scheduled_at, dtype=np.float64) - arrived
    num_output_tokens = sum(seq.max_tokens for seq in seqs)  # as max_model_len allows
    return SimResult(
        policy=name.lower(),
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_requests=len(requests),
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        num_output_tokens=num_output_tokens,
        num_queried_tokens=stats.num_queried_tokens,
        num_hit_tokens=stats.num_hit_tokens,
        num_prompt_hit_tokens=sum(seq.num_cached_tokens or 0 for seq in seqs),
        num_prefill_tokens=num_prefill_tokens,
        num_evictions=stats.num_evictions,
        num_preemptions=scheduler.num_preemptions,
        num_prefill_steps=num_prefill_steps,
        num_decode_steps=num_decode_steps,
        mean_ttft_steps=ttft_steps_total / len(requests) if requests else 0.0,
        simulated_seconds=clock,
        **_summary("ttft", ttft),
        **_summary("queueing", queueing),
        output_tokens_per_second=num_output_tokens / clock if clock else 0.0,
        wall_seconds=time.perf_counter() - start_wall,
        hit_rate=stats.hit_rate,
        ttft_seconds=ttft,
        queueing_seconds=queueing,
    )


def _summary(name: str, seconds: np.ndarray) -> dict[str, float]:
    """{mean_NAME_seconds, p50_..., p99_...} of some per-request seconds (0 for none)."""
    if not len(seconds):
        return {f"{stat}_{name}_seconds": 0.0 for stat in ("mean", "p50", "p99")}
    p50, p99 = np.percentile(seconds, [50, 99]).tolist()
    return {
        f"mean_{name}_seconds": float(seconds.mean()),
        f"p50_{name}_seconds": p50,
        f"p99_{name}_seconds": p99,
    }


def sweep(
    requests: Sequence[Request],
    config: SchedulerConfig,
    policies: Iterable[str | type[EvictionPolicy]] = POLICY_NAMES,
    cache_sizes: Iterable[int] = (),
    **simulate_kwargs,
) -> list[SimResult]:
    """`simulate` for every policy and cache size (in blocks; none given: `config.num_blocks`).

    Args:
        policies: names, or `EvictionPolicy` classes (each run gets a fresh instance).

    Raises:
        ValueError: a policy instance (it can serve one run only).
    """
    sizes = list(cache_sizes) or [config.num_blocks]
    policies = list(policies)
    for policy in policies:
        if isinstance(policy, EvictionPolicy):
            raise ValueError(
                f"sweep makes a policy per run: pass {type(policy).__name__}, the class, not an "
                "instance"
            )
    return [
        simulate(
            requests,
            dataclasses.replace(config, num_blocks=size),
            policy if isinstance(policy, str) else policy(),
            **simulate_kwargs,
        )
        for size in sizes
        for policy in policies
    ]
