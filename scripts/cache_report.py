"""The figures of docs/cache-policies.md, "A report": hit rate against cache size per policy with
Belady's ceiling, and TTFT CDFs per policy on one timed trace (simulated, no model; about a
minute on a 2-core CPU).

    python scripts/cache_report.py [--out docs/figures]

1. Zipf-popular prefixes (`workloads.prefix_repetition`), one request running at a time, so
   that Belady's offline choice is a ceiling (docs/cache-policies.md, "The optimal baseline").
2. A synthetic Mooncake-format trace with Poisson arrivals (`mooncake.synthetic_trace`), timed
   by the H200 cost model (`cost_model.H200_QWEN3_0_6B`), at one cache size, with the engine's
   batching (many requests running); `PrefixCostPolicy` weighs a block of the holder as 20 ms.
Prints the numbers behind both figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from jaxllm.research import workloads
from jaxllm.research.belady import BeladyPolicy
from jaxllm.research.cache_sim import default_cache_sizes, make_config, simulate, sweep
from jaxllm.research.cost_model import H200_QWEN3_0_6B
from jaxllm.research.mooncake import synthetic_trace, write_jsonl
from jaxllm.research.policies import PrefixCostPolicy
from jaxllm.research.sim_report import format_table, latency_cdf, plot

# NOTE: 20 ms a block of the holder: a few times the spacing of requests in the timed trace.
ONLINE = ["lru", "fifo", "lfu", "mru", lambda: PrefixCostPolicy(seconds_per_block=0.02)]
BLOCK_SIZE = 64
RATE = 100.0  # requests a second: enough that queueing shows in the TTFT


def hit_rate_figure(path: Path) -> None:
    requests = workloads.prefix_repetition(
        400, 16, 512, 64, 16, zipf_exponent=1.0, vocab_size=151_936, seed=0
    )
    config = make_config(requests, block_size=BLOCK_SIZE, prefill_tile=BLOCK_SIZE, max_num_seqs=1)
    sizes = [size for size in default_cache_sizes(requests, BLOCK_SIZE) if size <= 512]
    results = sweep(requests, config, ONLINE, sizes)
    for size in sizes:
        belady = BeladyPolicy.for_requests(requests, BLOCK_SIZE)
        results.append(simulate(requests, dataclasses.replace(config, num_blocks=size), belady))
    print(format_table(results))
    plot(
        results,
        path,
        title="400 requests, 16 prefixes of 512 tokens (Zipf 1.0), one at a time",
    )


def ttft_figure(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = synthetic_trace(2000, num_prefixes=50, request_rate=RATE, seed=0)
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace.jsonl"
        write_jsonl(trace, records)
        requests = workloads.load_trace(trace)
    config = make_config(requests, 2048, block_size=BLOCK_SIZE, prefill_tile=128)
    results = sweep(requests, config, ONLINE, arrival="time", cost_model=H200_QWEN3_0_6B)
    print(format_table(results))
    figure, axes = plt.subplots(figsize=(6, 3.6), dpi=100)
    for result in results:
        seconds, fraction = latency_cdf(result.ttft_seconds)
        axes.plot(seconds * 1e3, fraction, label=f"{result.policy.upper()} ({result.hit_rate:.0%})")
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (ms, simulated H200 0.6B steps)")
    axes.set_ylabel("fraction of requests")
    axes.grid(True, alpha=0.3)
    axes.legend(title="policy (token hit rate)", fontsize=8)
    title = f"2,000 requests of a Mooncake-format trace, {RATE:g}/s, 2,048 blocks"
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    for result in results:
        p50, p99 = np.percentile(result.ttft_seconds * 1e3, [50, 99])
        print(f"{result.policy:12} TTFT p50 {p50:8.1f} ms  p99 {p99:9.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/figures", help="a directory for the PNGs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hit_rate_figure(out / "cache-hit-rate-belady.png")
    ttft_figure(out / "cache-ttft-cdf.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
