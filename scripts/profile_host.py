"""Where the engine's wall time goes during the benchmark: `python scripts/profile_host.py`.

Runs bench.py's workload (nano-vllm's, 256 sequences; with `--json-schema` each under its JSON
schema) after a warm-up, and either
- profiles the host with cProfile (the default) and prints the functions with the most own time
  and the most cumulative time. Time spent waiting for the device shows under the call that
  reads the sampled tokens (`Engine._check` -> `numpy.asarray`); the rest of
  `Engine.step` is host work; or
- with `--device`, traces the device with JAX's profiler and prints its kernel time by kind
  (as `decode_step.py --profile`) against the wall time: what the device did over the whole
  run, and how long it sat idle. Tracing slows kernels a little; compare runs with each other.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time

import jax
from decode_step import by_kind, kernel_seconds  # scripts/decode_step.py

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.platform import ATTENTION_BACKENDS, ATTENTION_ENV
from jaxllm.research.bench import BENCH_SCHEMA, workload
from jaxllm.research.flags import at_least


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--attention", choices=ATTENTION_BACKENDS, default=None)
    parser.add_argument("--num-seqs", type=at_least(1), default=256)
    parser.add_argument("--device", action="store_true", help="trace the device, not the host")
    parser.add_argument(
        "--json-schema", action="store_true", help="every request under bench.py's JSON schema"
    )
    args = parser.parse_args()
    if args.attention:
        os.environ[ATTENTION_ENV] = args.attention
    llm = LLM(args.model)
    prompts, max_tokens = workload(args.num_seqs, 1024, 1024)
    schema = StructuredOutputsParams(json=BENCH_SCHEMA) if args.json_schema else None
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, structured_outputs=schema)
        for n in max_tokens
    ]
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)
    if args.device:
        trace_device(llm, prompts, params)
        return
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    print(f"generate: {time.perf_counter() - start:.2f} s (under the profiler)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


def trace_device(llm: LLM, prompts, params) -> None:
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    seconds = kernel_seconds(trace_dir)
    kinds = by_kind(seconds)
    print(f"\ndevice time over the run (s), wall {wall:.2f} s under the tracer")
    for kind, total in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"{kind:40s} {total:8.3f}")
    busy = sum(kinds.values())
    print(f"{'all kernels':40s} {busy:8.3f}")
    print(f"{'idle (wall less kernels)':40s} {wall - busy:8.3f}")
    print("\nlargest kernels over the run: s | name | hlo op | module")
    for key, total in sorted(seconds.items(), key=lambda item: -item[1])[:20]:
        print(f"{total:8.3f}  {' | '.join(key)[:100]}")


if __name__ == "__main__":
    main()
