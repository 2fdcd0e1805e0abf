"""The simulator's reports: a text table, CSV, JSON and a PNG plot of `cache_sim.SimResult`s.

`cache_sim` re-exports these functions; `scripts/cache_sim.py` writes them.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxllm.research.cache_sim import SimResult


def latency_cdf(seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of some latencies: ([n] sorted seconds, [n] fraction at or below each)."""
    ordered = np.sort(np.asarray(seconds, dtype=np.float64))
    return ordered, np.arange(1, len(ordered) + 1) / max(len(ordered), 1)


def write_csv(results: Sequence[SimResult], path: str | Path) -> None:
    """One row per run: every scalar of `SimResult.as_dict` (no per-request arrays)."""
    rows = [result.as_dict() for result in results]
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_json(
    results: Sequence[SimResult], path: str | Path, *, per_request: bool = False, **metadata
) -> None:
    """`metadata` and {"results": each run's `as_dict()`}; `per_request` adds each run's
    `ttft_seconds` and `queueing_seconds` lists (in the workload's order)."""
    runs = []
    for result in results:
        run = result.as_dict()
        if per_request:
            run["ttft_seconds"] = result.ttft_seconds.tolist()
            run["queueing_seconds"] = result.queueing_seconds.tolist()
        runs.append(run)
    Path(path).write_text(json.dumps(metadata | {"results": runs}, indent=1) + "\n")


def format_table(results: Sequence[SimResult]) -> str:
    """A fixed-width text table, one row per run; with a simulated clock, also TTFT in seconds
    (mean and p99) and output tokens per simulated second."""
    timed = any(r.simulated_seconds > 0 for r in results)
    width = max([6, *(len(r.policy) for r in results)])
    header = (
        f"{'policy':{width}} {'blocks':>7} {'hit rate':>8} {'prompt':>6} {'hit tokens':>11} "
        f"{'evictions':>9} {'preempt':>7} {'steps':>6} {'ttft steps':>10}"
    )
    if timed:
        header += f" {'ttft s':>8} {'p99 s':>8} {'out tok/s':>9}"
    lines = [header + f" {'wall s':>6}"]
    for r in results:
        line = (
            f"{r.policy:{width}} {r.num_blocks:7d} {r.hit_rate:8.3f} {r.prompt_hit_rate:6.3f} "
            f"{r.num_hit_tokens:11d} {r.num_evictions:9d} {r.num_preemptions:7d} "
            f"{r.num_prefill_steps + r.num_decode_steps:6d} {r.mean_ttft_steps:10.1f}"
        )
        if timed:
            line += (
                f" {r.mean_ttft_seconds:8.3f} {r.p99_ttft_seconds:8.3f} "
                f"{r.output_tokens_per_second:9.0f}"
            )
        lines.append(line + f" {r.wall_seconds:6.2f}")
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
