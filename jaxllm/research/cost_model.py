"""How long one engine step takes, as a linear function of the work its plan does (no jax).

The simulator (`cache_sim.simulate(..., cost_model=...)`) advances its clock by
`StepCostModel.step_seconds(step_work(plan, from_idle))` for every plan the scheduler makes;
`scripts/calibrate_step_cost.py` fits the prices to steps timed on the engine.

The work of a step (`StepWork`); `StepCostModel.prices` is a `StepWork` too, each field the
seconds one unit of that work costs:

- `num_forward_steps`: forward passes, 1 or K for a plan of K decode steps (its price: the
  overhead of a pass, whatever its size);
- `from_idle`: 1 when no step was in flight as the plan was made;
- `num_prefill_tokens`: prefill tokens the device computes (the plan's bucket, padding
  included);
- `num_prefill_pairs`: (query, key) pairs of prefill attention;
- `num_decode_rows`: decode rows the device computes (the bucket, padding included), summed
  over the plan's steps;
- `num_context_tokens`: context tokens decode attention reads (each row's context length),
  summed over the plan's steps.

Prefill attention is compute-bound (each new token attends to every token before it) and
decode attention bandwidth-bound (each row reads its context's K/V once), so the two have a
price each. The engine plans step N + 1 while the device runs step N, so a busy engine
hides its host work; the first step after an idle moment pays it: the price of `from_idle`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxllm.sched import StepPlan


class StepWork(NamedTuple):
    """What one plan makes the device do (see the module's table), or as
    `StepCostModel.prices`, the seconds a unit of each costs."""

    num_forward_steps: float = 1
    from_idle: float = 0
    num_prefill_tokens: float = 0
    num_prefill_pairs: float = 0
    num_decode_rows: float = 0
    num_context_tokens: float = 0


def attended_pairs(start_positions: list[int], num_new_tokens: list[int]) -> int:
    """(query, key) pairs when sequence i computes tokens start_i .. start_i + count_i - 1, each
    attending to itself and every token before it: sum of count * start + count (count + 1) / 2.
    """
    return sum(
        count * start + count * (count + 1) // 2
        for start, count in zip(start_positions, num_new_tokens, strict=True)
    )


def step_work(plan: StepPlan, from_idle: bool = False) -> StepWork:
    """The work of a scheduler plan; `from_idle`: no step was in flight when it was made."""
    bucket = plan.bucket
    if plan.is_prefill:
        pairs = attended_pairs(plan.start_positions, plan.num_new_tokens)
        return StepWork(1, int(from_idle), bucket.num_tokens, pairs, 0, 0)
    if bucket.num_steps == 1:  # one token per row, at position start: its context is start + 1
        context = sum(plan.start_positions) + plan.num_seqs
    else:
        context = attended_pairs(plan.start_positions, plan.num_new_tokens)
    steps = bucket.num_steps
    return StepWork(steps, int(from_idle), 0, 0, bucket.num_tokens * steps, context)


@dataclass(frozen=True)
class StepCostModel:
    """Seconds of an engine step: the work of its plan (`StepWork`), each unit at its price.

    Attributes:
        prices: seconds per unit of each kind of work, in a `StepWork`.
        description: where the prices come from (the model, the device, the fit).
    """

    prices: StepWork
    description: str = ""

    def step_seconds(self, work: StepWork) -> float:
        """Seconds of a step doing `work`."""
        return sum(price * amount for price, amount in zip(self.prices, work, strict=True))

    def plan_seconds(self, plan: StepPlan, from_idle: bool = False) -> float:
        """Seconds of the step that runs `plan`."""
        return self.step_seconds(step_work(plan, from_idle))

    def as_dict(self) -> dict:
        """The model as JSON data: what `save` writes and `load` reads."""
        return {"prices": self.prices._asdict(), "description": self.description}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        """Reads what `save` wrote.

        Raises:
            ValueError: not such a model (not JSON, a price unknown or missing, or not a
                finite number >= 0), naming the file.
            OSError: the file cannot be read.
        """
        try:
            record = json.loads(Path(path).read_text())
            prices = record.pop("prices")
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a step cost model ({error!r})") from None
        if not isinstance(prices, dict) or set(prices) != set(StepWork._fields):
            raise ValueError(
                f"{path}: a step cost model prices exactly {', '.join(StepWork._fields)}; got "
                f"{', '.join(prices) if isinstance(prices, dict) else repr(prices)}"
            )
        for name, price in prices.items():
            number = isinstance(price, int | float) and not isinstance(price, bool)
            if not (number and 0 <= price < math.inf):
                raise ValueError(
                    f"{path}: price {name} must be a finite number >= 0, got {price!r}"
                )
        return cls(StepWork(**prices), **record)

    @classmethod
    def fit(cls, samples: Iterable[tuple[StepWork, float]], description: str = "") -> StepCostModel:
        """The non-negative prices that minimise the squared *relative* error of the
        predicted seconds over measured (work, seconds) samples.

        Relative, so that the short decode steps weigh as much as the long prefills. A price
        whose work is zero in every sample comes out 0.

        Raises:
            ValueError: no sample, or a sample of zero or negative seconds.
        """
        samples = list(samples)
        if not samples:
            raise ValueError("fit needs at least one (work, seconds) sample")
        work = np.array([tuple(w) for w, _ in samples], dtype=np.float64)  # [n, 6]
        seconds = np.array([s for _, s in samples], dtype=np.float64)  # [n]
        if (seconds <= 0).any():
            raise ValueError("every sample must take more than 0 seconds")
        matrix = work / seconds[:, None]  # relative error: row i divided by seconds_i
        scale = np.abs(matrix).max(axis=0)
        scale[scale == 0] = 1.0  # an all-zero column keeps price 0
        solution = nnls(matrix / scale, np.ones(len(samples)))
        return cls(StepWork(*(solution / scale).tolist()), description)


def nnls(matrix: np.ndarray, target: np.ndarray, max_iterations: int | None = None) -> np.ndarray:
    """argmin ||matrix @ x - target|| over x >= 0 (Lawson and Hanson's active-set method).

    Args:
        matrix: [m, n]; target: [m].

    Returns:
        [n] the solution.
    """
    num_columns = matrix.shape[1]
    x = np.zeros(num_columns)
    free = np.zeros(num_columns, dtype=bool)  # the columns allowed above 0 (the passive set)
    tolerance = 10 * np.finfo(float).eps * np.abs(matrix).sum(axis=0).max() * max(matrix.shape)
    for _ in range(max_iterations or 3 * num_columns + 10):
        gradient = matrix.T @ (target - matrix @ x)  # [n]
        if free.all() or gradient[~free].max() <= tolerance:
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            candidate = np.zeros(num_columns)
            candidate[free] = np.linalg.lstsq(matrix[:, free], target, rcond=None)[0]
            if (candidate[free] > 0).all():
                x = candidate
                break
            # Move from x towards the candidate until a coefficient reaches 0; drop those.
            blocking = free & (candidate <= 0)
            step = np.min(x[blocking] / (x[blocking] - candidate[blocking]))
            x = x + step * (candidate - x)
            free &= x > tolerance
            x[~free] = 0.0
    return x


# Fitted on one H200 (`calibrate_step_cost.py replay --model random:qwen3-0.6b
# --calibration-requests 500 --num-requests 1000 --request-rate 20`, the engine's defaults): the
# calibration phases and a 500-request trace, 2,203 steps, mean relative error 10%; the replay of
# another 1,000 requests gave a simulated mean TTFT 0.96 of the engine's
# (docs/perf-runs/2026-12-02-h200-replay-1000-requests-calibration-trace.json).
H200_QWEN3_0_6B = StepCostModel(
    StepWork(
        num_forward_steps=2.01e-3,
        from_idle=2.93e-3,
        num_prefill_tokens=1.91e-6,
        num_prefill_pairs=2.45e-10,
        num_decode_rows=2.27e-6,
        num_context_tokens=2.38e-8,
    ),
    description="fitted on one H200 (random:qwen3-0.6b), checked by a replay: mean TTFT 0.96",
)
