"""The prefix-cache simulator: a workload through the real `Scheduler` and `BlockPool`, no model.

The step loop is the engine's (`Engine.step`): plan step N, then update step N - 1 with its
tokens; so with the engine's `SchedulerConfig` the simulator admits, evicts and preempts exactly
as the engine does and reports the same `CacheStats` (tests/engine/test_cache_sim_vs_engine.py).
Requests run with ignore_eos, so each makes exactly its max_tokens. The sampled tokens are
synthetic: always `SYNTHETIC_TOKEN`, so, as under greedy decoding, identical prompts produce
identical outputs (and share their output blocks) and different prompts never do.

Pure Python + numpy: no jax import. A run costs a few microseconds per
running sequence per step, plus the hashing of each prompt's blocks.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxllm.cache.eviction import POLICIES, EvictionPolicy
from jaxllm.research.workloads import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, SchedulerConfig

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
        mean_ttft_steps: mean steps from a request's arrival (its first step at or after
            arrival) to the step that sampled its first token, that step included.
        simulated_seconds: the simulated clock at the end (steps times `step_time`, plus idle
            time waiting for arrivals); 0 without a step time.
        wall_seconds: how long the simulation took on this machine.
        hit_rate: hit tokens over queried tokens (the pool's own `CacheStats.hit_rate`).
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
    wall_seconds: float
    hit_rate: float

    @property
    def prompt_hit_rate(self) -> float:
        """Prompt tokens served from the cache at first admission over all prompt tokens."""
        return (
            self.num_prompt_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"prompt_hit_rate": self.prompt_hit_rate}


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
        num_blocks=num_blocks or blocks_for_all(requests, block_size),
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
    check_integrity: bool = False,
) -> SimResult:
    """Replays `requests` through a fresh `Scheduler(config, eviction_policy=policy)`.

    Args:
        arrival: "order": every request is added before the first step, in list order (what
            `LLM.generate` does); "time": each is added before the first step that starts at or
            after its `arrival_time` (None counts as 0), with each step lasting `step_time`
            seconds and the clock jumping ahead when nothing is left to run.
        step_time: seconds per step (prefill or decode) in the simulated clock.
        check_integrity: check the scheduler's and the pool's invariants after every step
            (slow; for tests).

    Raises:
        ValueError: a request the scheduler refuses (too long for max_model_len or the cache).
    """
    if arrival not in ("order", "time"):
        raise ValueError(f"arrival must be 'order' or 'time', got {arrival!r}")
    start_wall = time.perf_counter()
    scheduler = Scheduler(config, eviction_policy=policy)
    params_of: dict[int, SamplingParams] = {}
    arrivals = [0.0 if arrival == "order" else (r.arrival_time or 0.0) for r in requests]
    order = sorted(range(len(requests)), key=arrivals.__getitem__)
    tokens = np.full(max(config.max_num_seqs, 1), SYNTHETIC_TOKEN, dtype=np.int32)
    seqs = []
    # NOTE: an offline policy (`belady.BeladyPolicy`) learns the run it replays.
    bind_run = getattr(scheduler.block_pool.policy, "bind_run", None)
    if bind_run is not None:
        bind_run(scheduler.block_pool, seqs)
    arrival_step: dict[int, int] = {}  # seq_id -> the first step it could run in
    ttft_steps_total = 0
    num_prefill_tokens = num_prefill_steps = num_decode_steps = 0
    clock = 0.0
    step = 0
    next_index = 0
    in_flight = None
    while next_index < len(order) or scheduler.has_unfinished() or in_flight is not None:
        if (
            next_index < len(order)
            and not scheduler.has_unfinished()
            and in_flight is None
            and arrivals[order[next_index]] > clock
        ):
            clock = arrivals[order[next_index]]
        while next_index < len(order) and arrivals[order[next_index]] <= clock:
            request = requests[order[next_index]]
            params = params_of.get(request.max_tokens)
            if params is None:
                params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
                params_of[request.max_tokens] = params
            seq = scheduler.new_sequence(request.prompt_token_ids, params)
            scheduler.add(seq)
            seqs.append(seq)
            arrival_step[seq.seq_id] = step
            next_index += 1
        plan = scheduler.schedule()
        if in_flight is not None:
            scheduler.update(in_flight, tokens)
        in_flight = plan
        if plan is None:
            continue
        step += 1
        clock += step_time
        if plan.is_prefill:
            num_prefill_steps += 1
            num_prefill_tokens += plan.num_tokens
            for seq, samples in zip(plan.seqs, plan.samples, strict=True):
                if samples and seq.seq_id in arrival_step:
                    ttft_steps_total += step - arrival_step.pop(seq.seq_id)
        else:
            num_decode_steps += 1
        if check_integrity:
            scheduler.check_integrity()
    stats = scheduler.stats()
    name = policy if isinstance(policy, str) else (policy.name or type(policy).__name__)
    return SimResult(
        policy=name.lower(),
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_requests=len(requests),
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        num_output_tokens=sum(r.max_tokens for r in requests),
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
        wall_seconds=time.perf_counter() - start_wall,
        hit_rate=stats.hit_rate,
    )


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
    """
    sizes = list(cache_sizes) or [config.num_blocks]
    policies = list(policies)
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


# Reports.


def write_csv(results: Sequence[SimResult], path: str | Path) -> None:
    rows = [result.as_dict() for result in results]
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_json(results: Sequence[SimResult], path: str | Path, **metadata) -> None:
    record = metadata | {"results": [result.as_dict() for result in results]}
    Path(path).write_text(json.dumps(record, indent=1) + "\n")


def format_table(results: Sequence[SimResult]) -> str:
    """A fixed-width text table, one row per run."""
    header = (
        f"{'policy':6} {'blocks':>7} {'hit rate':>8} {'prompt':>6} {'hit tokens':>11} "
        f"{'evictions':>9} {'preempt':>7} {'steps':>6} {'ttft steps':>10} {'wall s':>6}"
    )
    lines = [header]
    for r in results:
        lines.append(
            f"{r.policy:6} {r.num_blocks:7d} {r.hit_rate:8.3f} {r.prompt_hit_rate:6.3f} "
            f"{r.num_hit_tokens:11d} {r.num_evictions:9d} {r.num_preemptions:7d} "
            f"{r.num_prefill_steps + r.num_decode_steps:6d} {r.mean_ttft_steps:10.1f} "
            f"{r.wall_seconds:6.2f}"
        )
    return "\n".join(lines)


def plot(
    results: Sequence[SimResult],
    path: str | Path,
    title: str = "",
    metric: str = "prompt_hit_rate",
) -> None:
    """Hit rate against cache size, one line per policy, written as a PNG (needs matplotlib:
    `pip install -e .[plots]`).

    Args:
        metric: "prompt_hit_rate" (new prompts only) or "hit_rate" (every admission).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.6), dpi=100)
    for policy in dict.fromkeys(r.policy for r in results):
        points = sorted((r.num_blocks, getattr(r, metric)) for r in results if r.policy == policy)
        axes.plot(*zip(*points, strict=True), marker="o", label=policy.upper())
    block_size = results[0].block_size
    axes.set_xscale("log", base=2)
    sizes = sorted({r.num_blocks for r in results})
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.minorticks_off()
    axes.set_xlabel(f"KV cache size (blocks of {block_size} tokens)")
    axes.set_ylabel({"hit_rate": "token hit rate"}.get(metric, "prompt token hit rate"))
    axes.set_ylim(0, 1)
    axes.grid(True, alpha=0.3)
    axes.legend()
    if title:
        axes.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
