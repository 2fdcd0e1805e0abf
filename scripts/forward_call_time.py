"""How long the forward executable's call holds the host in a decode step:
`python scripts/forward_call_time.py [--model random:qwen3-0.6b] [--batch 256] [--context 1024]`.

Compiles the engine's decode bucket for `--batch` rows of `--context` tokens and calls it on a
step of padding, the device idle before each call ("idle") and back to back ("queued"), with
the params as the engine made them and as copies (one copy op per param, or one jitted copy of
the whole tree). Then traces 20 idle calls and sums the host's profiler events by name: where
the call's time goes. Prints the medians and the events.

With `--addresses`, times the calls of the bucket's forward pass back to back, the host's time
per call and the wall time per call of 100 queued ones, with its small inputs (the packed host
arrays, the previous step's tokens) new device buffers every call (XLA re-records the step's CUDA
graph when an address changes), the same buffers every call, or copied first into buffers of
fixed addresses by a program of their own (donated, so updated in place).

With `--readback`, at one row: how long reading a step's sampled tokens back to the host takes
while the next forward call is being made on another thread (the tokens ready on the device,
held in device memory or written by their program to pinned host memory), and a constrained
stream's steps as the engine runs them (the next forward call made right after the sampler's,
on a thread; the tokens read back, `--mask-us` of grammar work, the sampler called under the
mask), ms per token with each kind of tokens.

With `--generate`, times the forward calls of the decode steps of `generate` (by
default 256 prompts of 500 tokens, 150 output tokens each; the first run compiles), the device
busy and then idle before each call, and sums the host's events of one traced run per decode
step.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import glob
import itertools
import sys
import tempfile
import threading
import time

import jax
import numpy as np
from jax import lax

from jaxllm import LLM, SamplingParams, steps
from jaxllm.research.flags import at_least
from jaxllm.steps import pack


def call_times(call, runs: int) -> tuple[float, float]:
    """Median ms of `call()` with the device idle before each, then queued back to back."""
    idle, queued = [], []
    for _ in range(runs):
        jax.block_until_ready(call.last)
        start = time.perf_counter()
        call()
        idle.append(time.perf_counter() - start)
    jax.block_until_ready(call.last)
    for _ in range(runs):
        start = time.perf_counter()
        call()
        queued.append(time.perf_counter() - start)
    jax.block_until_ready(call.last)
    return 1e3 * float(np.median(idle)), 1e3 * float(np.median(queued))


def host_events(trace_dir: str, calls: int) -> list[tuple[str, float, float]]:
    """(name, ms per call, runs per call) of the host planes' events."""
    from jax.profiler import ProfileData

    [path] = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for plane in ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for event in line.events:
                total[event.name] += event.duration_ns * 1e-6
                count[event.name] += 1
    return sorted(
        ((name, ms / calls, count[name] / calls) for name, ms in total.items()),
        key=lambda row: -row[1],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--batch", type=at_least(1), default=256)
    parser.add_argument("--context", type=at_least(1), default=1024)
    parser.add_argument("--runs", type=at_least(1), default=50)
    parser.add_argument("--generate", action="store_true")
    parser.add_argument("--addresses", action="store_true")
    parser.add_argument("--readback", action="store_true")
    parser.add_argument("--mask-us", type=float, default=100.0)
    parser.add_argument("--prompts", type=at_least(1), default=256)
    parser.add_argument("--prompt-len", type=at_least(1), default=500)
    parser.add_argument("--max-tokens", type=at_least(1), default=150)
    args = parser.parse_args()
    if args.generate:
        in_generate(args.model, args.prompts, args.prompt_len, args.max_tokens)
        return
    if args.addresses:
        by_address(args.model, args.batch, args.context, args.runs)
        return
    if args.readback:
        readback(args.model, args.context, args.runs, args.mask_us)
        return
    llm = LLM(args.model, compile_at_startup=False, max_num_seqs=args.batch)
    engine = llm.engine
    runner = engine.runner
    blocks = -(-args.context // engine.scheduler.config.block_size)
    bucket = engine.scheduler.ladder.decode_bucket(args.batch, blocks)
    runner.compile([bucket], use_tqdm=False)
    inputs, sampling = bucket.padding()
    host = (pack((*inputs, np.full(bucket.num_tokens, -1, np.int32))), pack(sampling))

    def call():
        call.last = runner._run_forward(bucket, host, runner._no_tokens)[0]

    call.last = runner.kv_cache
    call()
    made = runner.params
    variants = {
        "as made": made,
        "copied, one op per param": jax.tree.map(lambda x: x.copy(), made),
        "copied, one jit": jax.jit(lambda tree: jax.tree.map(lambda x: x * 1, tree))(made),
    }
    rows = []
    for name, params in variants.items():
        runner.params = params
        call()
        rows.append((name, *call_times(call, args.runs)))
    runner.params = made
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(20):
            jax.block_until_ready(call.last)
            call()
        jax.block_until_ready(call.last)
    print(f"\nhost events per idle call ({bucket})")
    for name, ms, runs in host_events(trace_dir, 20)[:30]:
        print(f"{ms:9.3f} ms {runs:7.1f}x  {name[:90]}")
    print(f"\n{args.model}, {bucket}: forward call, ms (median of {args.runs})")
    print(f"{'params':32} {'idle':>8} {'queued':>8}")
    for name, idle, queued in rows:
        print(f"{name:32} {idle:8.3f} {queued:8.3f}")


def by_address(model: str, batch: int, context: int, runs: int) -> None:
    llm = LLM(model, compile_at_startup=False, max_num_seqs=max(batch, 8))
    engine = llm.engine
    runner = engine.runner
    blocks = -(-context // engine.scheduler.config.block_size)
    bucket = engine.scheduler.ladder.decode_bucket(batch, blocks)
    runner.compile([bucket], use_tqdm=False)
    inputs, _ = bucket.padding()
    host = pack((*inputs, np.full(bucket.num_tokens, -1, np.int32)))
    tokens = [jax.device_put(np.zeros(runner.max_sampled_rows, np.int32)) for _ in range(5)]

    # Written into the donated buffers (a program that returned `new` itself would hand back
    # the new buffers, its outputs forwarded from its inputs)
    def write(buffer, new):
        return lax.dynamic_update_slice(buffer, new, (0,))

    stage = jax.jit(lambda buffers, new: jax.tree.map(write, buffers, new), donate_argnums=0)
    staged = [jax.device_put(host), tokens[0] + 0]
    fixed = jax.device_put(host)

    def forward(packed, previous):
        # NOTE: the logits are dropped at once, as the engine's step drops them: the next
        # call's logits take the same address
        _, runner.kv_cache = runner._forward_executables[bucket](
            runner.params, runner.kv_cache, packed, previous
        )

    def new_buffers(i):
        forward(host, tokens[i % 5])

    def same_buffers(i):
        forward(fixed, tokens[0])

    def staged_buffers(i):
        staged[:] = stage(staged, [host, tokens[i % 5]])
        forward(*staged)

    noop = jax.jit(lambda x: x + 1)

    def trivial(i):
        noop(tokens[0])

    rows = []
    calls = [("new", new_buffers), ("same", same_buffers), ("staged", staged_buffers)]
    for name, call in [*calls, ("x + 1", trivial)]:
        print(f"=== inputs: {name}", file=sys.stderr, flush=True)
        for i in range(10):
            call(i)
        jax.block_until_ready(runner.kv_cache)
        if name == "staged":
            addresses = {tuple(b.unsafe_buffer_pointer() for b in staged)}
            for i in range(10):
                call(i)
                addresses.add(tuple(b.unsafe_buffer_pointer() for b in staged))
            print(f"staged buffers: {len(addresses)} address pairs in 11 calls", file=sys.stderr)
        host_ms, idle_ms = [], []
        for i in range(runs):
            start = time.perf_counter()
            call(i)
            jax.block_until_ready(runner.kv_cache)
            idle_ms.append(1e3 * (time.perf_counter() - start))
        start_all = time.perf_counter()
        for i in range(100):
            start = time.perf_counter()
            call(i)
            host_ms.append(1e3 * (time.perf_counter() - start))
        jax.block_until_ready(runner.kv_cache)
        wall = 1e3 * (time.perf_counter() - start_all) / 100
        rows.append((name, np.median(host_ms), wall, np.median(idle_ms)))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for i in range(20):
            same_buffers(i)
        jax.block_until_ready(runner.kv_cache)
    print("\nhost events per call, the same inputs every call")
    for name, ms, count in host_events(trace_dir, 20)[:24]:
        print(f"{ms:9.3f} ms {count:7.1f}x  {name[:90]}")
    print(f"\n{model}, {bucket}: forward calls, ms")
    print(f"{'inputs':8} {'host/call':>10} {'wall/call':>10} {'one call':>10}")
    for name, host_ms, wall, idle in rows:
        print(f"{name:8} {host_ms:10.3f} {wall:10.3f} {idle:10.3f}")


def readback(model: str, context: int, runs: int, mask_us: float) -> None:
    llm = LLM(model, compile_at_startup=False, max_num_seqs=8)
    runner = llm.engine.runner
    blocks = -(-context // llm.engine.scheduler.config.block_size)
    bucket = llm.engine.scheduler.ladder.decode_bucket(1, blocks)
    runner.compile([bucket], use_tqdm=False, sampler_modes=["greedy"], logprobs=False)
    inputs, sampling = bucket.padding()
    previous = np.full(bucket.num_tokens, -1, np.int32)
    previous[0] = 0  # the row's token is the one the previous step sampled
    pinned = jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind="pinned_host")
    sample = functools.partial(
        steps.sample_step, num_rows=runner.max_sampled_rows, mode="greedy",
        fused_argmax=runner.kernels.fused_argmax,
    )  # fmt: skip
    packed_sampling = pack(sampling)
    host = (pack((*inputs, previous)), packed_sampling)
    logits = runner._run_forward(bucket, host, runner._no_tokens)[0]
    every_token = runner.processors.bitmask(1, None)
    on_device = runner._replicated
    samplers = {  # the tokens for the next forward pass, and for the host
        name: jax.jit(sample, out_shardings=(on_device, for_host))
        .lower(logits, packed_sampling, every_token)
        .compile()
        for name, for_host in (("device", on_device), ("pinned host", pinned))
    }
    bitmask = np.full((1, -(-runner.config.vocab_size // 32)), -1, np.int32)
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def forward(tokens):
        return runner._run_forward(bucket, host, tokens)[0]

    def launch(tokens, started):
        started.set()
        start = time.perf_counter()
        out = forward(tokens)
        return start, time.perf_counter(), out

    rows = []
    for name, sampler in samplers.items():
        for copy in (False, True):
            if copy and name != "device":
                continue
            waits, left, calls = [], [], []
            for _ in range(runs):
                logits = forward(runner._no_tokens)
                tokens, host_tokens = sampler(logits, packed_sampling, every_token)
                if copy:
                    host_tokens.copy_to_host_async()
                jax.block_until_ready(host_tokens)
                started = threading.Event()
                future = pool.submit(launch, tokens, started)
                started.wait()
                time.sleep(2e-4)
                start = time.perf_counter()
                np.asarray(host_tokens)
                waits.append(time.perf_counter() - start)
                call_start, call_end, out = future.result()
                left.append(call_end - start)
                calls.append(call_end - call_start)
                jax.block_until_ready(out)
            label = name + (", copy started" if copy else "")
            rows.append((label, *(1e3 * float(np.median(x)) for x in (waits, left, calls))))
    loop = []
    for name, sampler in samplers.items():
        for _ in range(2):  # the first round warms up
            logits = forward(runner._no_tokens)
            tokens, host_tokens = sampler(logits, packed_sampling, every_token)
            future = pool.submit(forward, tokens)
            jax.block_until_ready(tokens)
            start = time.perf_counter()
            for _ in range(runs * 4):
                np.asarray(host_tokens)
                time.sleep(mask_us * 1e-6)  # the grammars advance, the masks fill
                tokens, host_tokens = sampler(future.result(), packed_sampling, bitmask)
                future = pool.submit(forward, tokens)
            jax.block_until_ready(future.result())
            per_token = 1e3 * (time.perf_counter() - start) / (runs * 4)
        loop.append((name, per_token))
    print(f"\n{model}, {bucket}: tokens read back during the next forward call, ms (median)")
    print(f"{'tokens':22} {'read back':>10} {'call left':>10} {'call':>8}")
    for label, wait, call_left, call in rows:
        print(f"{label:22} {wait:10.3f} {call_left:10.3f} {call:8.3f}")
    print(f"constrained steps, {mask_us:.0f} us of grammar work each: ms per token")
    for name, per_token in loop:
        print(f"{name:22} {per_token:10.3f}")


def in_generate(model: str, num_prompts: int, prompt_len: int, max_tokens: int) -> None:
    llm = LLM(model, compile_at_startup=False)
    runner = llm.engine.runner
    original = runner._run_forward
    times = collections.defaultdict(list)
    mode = ["compile"]

    addresses = collections.defaultdict(list)

    def timed(bucket, host, previous_tokens):
        if mode[0] == "idle":
            jax.block_until_ready(runner.kv_cache)
        start = time.perf_counter()
        out = original(bucket, host, previous_tokens)
        if bucket[0] == "decode":
            times[mode[0]].append(time.perf_counter() - start)
            if mode[0] == "queued":
                addresses["logits"].append(out[0].unsafe_buffer_pointer())
                addresses["previous tokens"].append(previous_tokens.unsafe_buffer_pointer())
                addresses["kv cache"].append(
                    jax.tree.leaves(runner.kv_cache)[0].unsafe_buffer_pointer()
                )
        return out

    runner._run_forward = timed
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, prompt_len).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    for m in ("compile", "queued", "traced", "idle"):
        mode[0] = m
        trace_dir = tempfile.mkdtemp()
        start = time.perf_counter()
        if m == "traced":
            with jax.profiler.trace(trace_dir):
                llm.generate(prompts, params, use_tqdm=False)
        else:
            llm.generate(prompts, params, use_tqdm=False)
        print(f"{m}: generate {time.perf_counter() - start:.2f} s", flush=True)
        if m == "traced":
            steps = len(times["traced"])
            print(f"host events per decode step ({steps} decode steps)")
            for name, ms, runs in host_events(trace_dir, steps)[:40]:
                print(f"{ms:9.3f} ms {runs:7.1f}x  {name[:90]}")
    print("\ndevice addresses over the queued run's decode steps: distinct, changes, first 8")
    for name, seq in addresses.items():
        changes = sum(a != b for a, b in itertools.pairwise(seq))
        first = " ".join(f"{a % 10**9:09d}" for a in seq[:8])
        print(f"{name:16} {len(set(seq)):4d} {changes:4d}  {first}")
    print(f"\n{model}: decode steps' forward call in generate, ms")
    for m in ("queued", "idle"):
        t = 1e3 * np.array(times[m])
        print(f"{m:8} median {np.median(t):.3f}, min {t.min():.3f}, steps {len(t)}")


if __name__ == "__main__":
    main()
