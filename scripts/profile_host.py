"""Where the engine's wall time goes during the benchmark: `python scripts/profile_host.py`.

Runs bench.py's workload (nano-vllm's, 256 sequences; with `--json-schema` each under its JSON
schema) after a warm-up, and either
- profiles the host with cProfile (the default) and prints the functions with the most own time
  and the most cumulative time. Time spent waiting for the device shows under the call that
  reads the sampled tokens (`Engine._apply_in_flight` -> `numpy.asarray`); the rest of
  `Engine.step` is host work; or
- with `--device`, traces the device with JAX's profiler in windows of the run (`--windows`,
  seconds from its start, each `--window-length` long) and prints each window's kernel time by
  kind (as `decode_step.py --profile`) against its wall time: what the device did then, and how
  long it sat idle (windows: a trace of the whole run, 256 sequences, takes over 500 s on an
  H100). Tracing slows kernels a little; compare runs with each other.
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
        "--windows",
        type=float,
        nargs="+",
        default=[0.5, 2.0, 4.0],
        help="--device: when each traced window starts, seconds into the run",
    )
    parser.add_argument("--window-length", type=float, default=0.3, help="--device: seconds")
    parser.add_argument(
        "--json-schema", action="store_true", help="every request under bench.py's JSON schema"
    )
    args = parser.parse_args()
    if args.window_length <= 0 or min(args.windows) < 0:
        parser.error("--windows take seconds of at least 0, --window-length more than 0")
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
        trace_device(llm, prompts, params, args.windows, args.window_length)
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


def trace_device(llm: LLM, prompts, params, starts: list[float], length: float) -> None:
    """Runs the workload, tracing the device in a window of `length` s from each of `starts`.

    Each window opens and closes between two engine steps, on the thread that runs them: CUPTI
    failed to subscribe (`CUPTI_ERROR_NOT_INITIALIZED`) when a trace started on another thread
    while the run launched kernels, and the run then died."""
    windows = []  # (start, trace directory, seconds traced)
    pending = sorted(starts)
    engine_step = llm.engine.step
    opened = None  # the open window: (start, trace directory, when it opened)
    begin = time.perf_counter()

    def close() -> None:
        nonlocal opened
        jax.profiler.stop_trace()
        start, trace_dir, since = opened
        windows.append((start, trace_dir, time.perf_counter() - since))
        opened = None

    def step():
        nonlocal opened
        now = time.perf_counter()
        if opened is not None and now - opened[2] >= length:
            close()
        if opened is None and pending and now - begin >= pending[0]:
            trace_dir = tempfile.mkdtemp()
            jax.profiler.start_trace(trace_dir)
            opened = (pending.pop(0), trace_dir, time.perf_counter())
        return engine_step()

    llm.engine.step = step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.engine.step
        if opened is not None:
            close()
    print(f"\nrun: {time.perf_counter() - begin:.2f} s under the tracer's windows")
    for start, trace_dir, wall in windows:
        seconds = kernel_seconds(trace_dir)
        kinds = by_kind(seconds)
        busy = sum(kinds.values())
        print(f"\nwindow from {start} s, {wall * 1e3:.1f} ms: device time (ms) by kind")
        for kind, total in sorted(kinds.items(), key=lambda item: -item[1]):
            print(f"{kind:40s} {total * 1e3:8.2f}")
        print(f"{'all kernels':40s} {busy * 1e3:8.2f}")
        print(f"{'idle (window less kernels)':40s} {(wall - busy) * 1e3:8.2f}")
        print("largest kernels: ms | name | hlo op | module")
        for key, total in sorted(seconds.items(), key=lambda item: -item[1])[:12]:
            print(f"{total * 1e3:8.2f}  {' | '.join(key)[:100]}")


if __name__ == "__main__":
    main()
