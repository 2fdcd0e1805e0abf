"""Host cost of one engine step without a model: `Scheduler.schedule()` (the plan and its
padded arrays) and `Scheduler.update()`.

    python scripts/host_bench.py [--iterations 300]

Scenarios (block size 256, prefill tile 128, budget 16,384 tokens, prefix caching on):
- decode-256: one decode step of 256 running requests with ~1,000 tokens of context each;
  also `update()` of that step (one token per request), which the engine pays as well;
- decode-1: the same for one request (one stream);
- prefill-1x16384: admission and layout of one 16,384-token prompt (64 blocks hashed);
- prefill-16x1024: 16 prompts of 1,024 tokens in one step;
- prefill-16x1024-shared: the same, after a batch sharing each prompt's first 768 tokens
  finished (3 of each prompt's 4 blocks hit the prefix cache).
Prints the median and 99th percentile per scenario in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from jaxllm.research.flags import at_least
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, SchedulerConfig

BLOCK_SIZE = 256
BUDGET = 16384


def make_config(max_model_len: int, num_blocks: int) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=256,
        max_num_batched_tokens=BUDGET,
        max_model_len=max_model_len,
        prefill_tile=128,
    )


def run_all_prefills(scheduler: Scheduler) -> None:
    """Steps until every request is decoding (feeds token 1 to every sampled row)."""
    while scheduler.waiting or any(
        s.num_tokens - s.num_computed_tokens > 1 for s in scheduler.running
    ):
        plan = scheduler.schedule()
        scheduler.update(plan, np.ones(plan.num_seqs, np.int32))


def add(scheduler: Scheduler, prompt, params: SamplingParams) -> None:
    scheduler.add(scheduler.new_sequence(prompt, params))


def timed(setup: Callable[[], Callable[[], object]], iterations: int) -> list[float]:
    """Microseconds of `setup()()` per iteration; `setup` itself is not timed."""
    samples = []
    for _ in range(iterations):
        work = setup()
        start = time.perf_counter()
        work()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def bench_decode(iterations: int, num_seqs: int = 256) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    scheduler = Scheduler(make_config(4096, 4096))
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2048, ignore_eos=True)
    for _ in range(num_seqs):
        add(scheduler, rng.integers(0, 150_000, int(rng.integers(900, 1100))), params)
    run_all_prefills(scheduler)
    tokens = np.ones(num_seqs, np.int32)
    schedule, update = [], []
    for _ in range(iterations):  # whole decode steps, each planned and updated
        start = time.perf_counter()
        plan = scheduler.schedule()
        planned = time.perf_counter()
        scheduler.update(plan, tokens)
        schedule.append((planned - start) * 1e6)
        update.append((time.perf_counter() - planned) * 1e6)
    assert plan.num_seqs == num_seqs and not plan.is_prefill
    return {f"decode-{num_seqs} schedule": schedule, f"decode-{num_seqs} update": update}


def bench_prefill(
    name: str, prompt_len: int, num_prompts: int, iterations: int, shared: bool = False
) -> dict[str, list[float]]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 150_000, prompt_len) for _ in range(num_prompts)]
    config = make_config(
        max(4096, prompt_len + 512), 4 * num_prompts * (prompt_len // BLOCK_SIZE + 1)
    )
    params = SamplingParams(max_tokens=1)

    def setup() -> Callable[[], object]:
        scheduler = Scheduler(config)
        if shared:
            for prompt in prompts:
                add(scheduler, prompt, params)
            while scheduler.has_unfinished():
                plan = scheduler.schedule()
                scheduler.update(plan, np.ones(plan.num_seqs, np.int32))
        for prompt in prompts:
            add(scheduler, prompt[: 3 * prompt_len // 4].tolist() + [7] * (prompt_len // 4), params)
        return scheduler.schedule

    return {f"{name} schedule": timed(setup, iterations)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=at_least(1), default=300)
    args = parser.parse_args()
    results = bench_decode(args.iterations) | bench_decode(args.iterations, num_seqs=1)
    results |= bench_prefill("prefill-1x16384", 16384, 1, args.iterations)
    results |= bench_prefill("prefill-16x1024", 1024, 16, args.iterations)
    results |= bench_prefill("prefill-16x1024-shared", 1024, 16, args.iterations, shared=True)
    print(f"{'scenario':<40} {'median us':>10} {'p99 us':>10}")
    for name, samples in results.items():
        p99 = float(np.percentile(samples, 99))
        print(f"{name:<40} {statistics.median(samples):>10.1f} {p99:>10.1f}")


if __name__ == "__main__":
    main()
