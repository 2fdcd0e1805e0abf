"""Where the engine's wall time goes during the benchmark: `python scripts/profile_host.py`.

Runs bench.py's workload (nano-vllm's, 256 sequences) under cProfile after a warm-up and prints
the functions with the most own time and the most cumulative time. Time spent waiting for the
device shows under the call that reads the sampled tokens (`Engine._apply_in_flight` ->
`numpy.asarray`); the rest of `Engine.step` is host work.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from jaxllm import LLM, SamplingParams
from jaxllm.bench import workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--num-seqs", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(args.model, attention_backend=args.attention)
    prompts, max_tokens = workload(args.num_seqs, 1024, 1024)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    print(f"generate: {time.perf_counter() - start:.2f} s (under the profiler)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
