"""Where a benchmark run's time goes, by batch size, against the bound:

    python scripts/step_costs.py [bench.py's flags]     # e.g. --json-schema, --num-seqs 64

Runs `scripts/bench.py` with the engine's steps timed one by one, then prints, for prefill plans
and for decode plans by the rows they run, the plans, their forward passes, their wall time and
the bound's time for the same work (`jaxllm.research.bound`: weights once a forward pass and
each row's KV at the H200's bandwidth; prefill FLOPs at its matmul rate), and what each band's
excess over its bound costs of the run.

A step dispatches its plan and then waits for the plan before it (`Engine.step`), so a step's
wall time is booked to the plan before it: in a run the device never waits on, the time that
plan kept the device.
"""

from __future__ import annotations

import itertools
import sys
import time

from jaxllm.engine import Engine
from jaxllm.research import bench
from jaxllm.research.bound import H200_BANDWIDTH, H200_FLOPS, model_sizes
from jaxllm.research.cost_model import step_work

# Decode plans by rows: the balanced decode kernel from 128, multi-step plans up to 32.
BANDS = ((1, 8), (9, 32), (33, 64), (65, 127), (128, 256), (257, 1 << 20))


def timed_steps():
    """Wraps `Engine.step`; returns the list of (the plan's work (`work`) or None, seconds) it
    fills, one entry a step."""
    steps, step = [], Engine.step

    def timed(engine):
        start = time.perf_counter()
        outputs = step(engine)
        seconds = time.perf_counter() - start
        plan = engine._in_flight[0] if engine._in_flight else None
        steps.append((plan and work(engine.runner.config, plan), seconds))
        return outputs

    Engine.step = timed
    return steps


def work(config, plan) -> tuple[str, float, int]:
    """(band, the bound's seconds, forward passes) of a plan just dispatched."""
    params, weight_bytes, kv_bytes = model_sizes(config, dtype_bytes=config.jnp_dtype.itemsize)
    done, passes = step_work(plan), plan.bucket.num_steps
    if plan.is_prefill:
        pair_flops = 4 * config.num_heads * config.head_dim * config.num_layers  # QK and PV
        flops = 2 * params * plan.num_tokens + pair_flops * done.num_prefill_pairs
        return "prefill", flops / H200_FLOPS, passes
    band = next(f"decode {lo}-{hi}" for lo, hi in BANDS if lo <= plan.num_seqs <= hi)
    return (
        band,
        (passes * weight_bytes + done.num_context_tokens * kv_bytes) / H200_BANDWIDTH,
        passes,
    )


def report(steps) -> None:
    by_band: dict[str, list[float]] = {}
    # Each step's time belongs to the plan dispatched by the step before it.
    for (planned, _), (_, seconds) in itertools.pairwise(steps):
        if planned is None:
            continue
        band, bound, passes = planned
        totals = by_band.setdefault(band, [0, 0, 0.0, 0.0])
        totals[0] += 1
        totals[1] += passes
        totals[2] += seconds
        totals[3] += bound
    wall = sum(t[2] for t in by_band.values())
    print(
        f"\n{'plans':>20} {'passes':>7} {'s':>7} {'bound s':>8} {'ratio':>6} {'ms/pass':>8} "
        f"{'excess s':>9} {'of run':>7}"
    )
    order = ["prefill", *(f"decode {lo}-{hi}" for lo, hi in BANDS)]
    for band in sorted(by_band, key=order.index):
        plans, passes, seconds, bound = by_band[band]
        print(
            f"{band:>14} {plans:>5} {passes:>7} {seconds:7.3f} {bound:8.3f} "
            f"{bound / seconds:6.2f} {1e3 * seconds / passes:8.2f} {seconds - bound:9.3f} "
            f"{(seconds - bound) / wall:7.1%}"
        )
    bound = sum(t[3] for t in by_band.values())
    print(f"{'all':>14} {'':>5} {'':>7} {wall:7.3f} {bound:8.3f} {bound / wall:6.2f}")


def main(argv: list[str]) -> int:
    steps = timed_steps()
    code = bench.main(argv)
    # The warm-up's steps and the run's: the run's are those after the last idle step.
    starts = [i for i, (planned, _) in enumerate(steps) if planned is None]
    report(steps[starts[-2] + 1 :] if len(starts) > 1 else steps)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
