"""How long a one-step plan's sampler call holds the host, alone and under a token mask:
`python scripts/sampler_call_time.py [--model random:qwen3-0.6b] [--rows 1] [--runs 200]`.

Compiles the engine's decode bucket of `--rows` rows, takes its logits once, then calls, back
to back (the device queued) and with the device idle before each call, the sampler ("random"
mode) as the engine calls it: its settings on the device (on an NVIDIA GPU `FixedInputs` writes
them with the forward pass's inputs) and every token allowed, or under a host bitmask (a
constrained step); then with its settings from a host array, behind the mask's own program
(as it ran before the sampler took the mask), compiled without command buffers (GPU). Then
traces 20 idle calls of the engine's two and sums the host's profiler events by name. Prints ms
per call.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from forward_call_time import host_events

from jaxllm import LLM
from jaxllm.model.inputs import SamplingInputs
from jaxllm.research.flags import at_least
from jaxllm.steps import pack

MODE = "random"


def timed(call, runs: int) -> tuple[float, float, float]:
    """Median host ms of `call()` queued back to back, wall ms a call of them, and the median
    host ms with the device idle before each call."""
    for _ in range(10):
        call()
    jax.block_until_ready(call.last)
    queued, start = [], time.perf_counter()
    for _ in range(runs):
        begin = time.perf_counter()
        call()
        queued.append(time.perf_counter() - begin)
    jax.block_until_ready(call.last)
    wall = (time.perf_counter() - start) / runs
    idle = []
    for _ in range(runs):
        jax.block_until_ready(call.last)
        begin = time.perf_counter()
        call()
        idle.append(time.perf_counter() - begin)
    return 1e3 * float(np.median(queued)), 1e3 * wall, 1e3 * float(np.median(idle))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--rows", type=at_least(1), default=1)
    parser.add_argument("--runs", type=at_least(1), default=200)
    args = parser.parse_args()
    llm = LLM(args.model, compile_at_startup=False, max_num_seqs=max(args.rows, 8))
    runner = llm.engine.runner
    bucket = llm.engine.scheduler.ladder.decode_bucket(args.rows, 1)
    runner.compile([bucket], use_tqdm=False, sampler_modes=(MODE,), logprobs=False)
    inputs, _ = bucket.padding()
    rows = bucket.num_sampled
    sampling = SamplingInputs.padding(rows)._replace(temperature=np.full(rows, 0.6, np.float32))
    host = (pack((*inputs, np.full(bucket.num_tokens, -1, np.int32))), pack(sampling))
    logits = runner._run_forward(bucket, host, runner._no_tokens)[0]
    settings = jax.device_put(host[1], runner._replicated)
    bitmask = np.full((rows, -(-runner.config.vocab_size // 32)), -1, np.int32)
    sampler = runner._run_sampler
    variants = {
        "the engine's, free": lambda: sampler(rows, MODE, logits, settings),
        "the engine's, under a host mask": lambda: sampler(rows, MODE, logits, settings, bitmask),
        "settings from the host": lambda: sampler(rows, MODE, logits, host[1]),
        "mask program, then sampler": lambda: sampler(
            rows, MODE, runner.processors.mask(logits, bitmask), host[1]
        ),
        "x + 1": lambda: jnp.add(settings, 1),
    }
    if jax.default_backend() == "gpu":
        every_token = runner.processors.bitmask(rows, None)
        plain = runner._sample.lower(logits, host[1], every_token, mode=MODE).compile(
            compiler_options={"xla_gpu_enable_command_buffer": ""}
        )
        variants["no command buffer"] = lambda: plain(logits, settings, every_token)
    results = {}
    for name, function in variants.items():
        print(f"=== {name}", file=sys.stderr, flush=True)

        def call(function=function):
            call.last = function()

        call.last = logits
        results[name] = timed(call, args.runs)
    for name in list(variants)[:2]:
        trace_dir = tempfile.mkdtemp()
        with jax.profiler.trace(trace_dir):
            for _ in range(20):
                last = variants[name]()
                jax.block_until_ready(last)
        print(f"\nhost events per idle call: {name}")
        for event, ms, runs in host_events(trace_dir, 20)[:16]:
            print(f"{ms:9.3f} ms {runs:7.1f}x  {event[:90]}")
    print(f"\n{args.model}, {rows} rows, {MODE} sampler: calls, ms (median of {args.runs})")
    print(f"{'call':40} {'host queued':>11} {'wall':>8} {'host idle':>9}")
    for name, (queued, wall, idle) in results.items():
        print(f"{name:40} {queued:11.3f} {wall:8.3f} {idle:9.3f}")


if __name__ == "__main__":
    main()
