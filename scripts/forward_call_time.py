"""How long the forward executable's call holds the host in decode steps:
`python scripts/forward_call_time.py NAME`.

Runs 256 prompts of 500 random tokens, 150 output tokens each, through `random:qwen3-0.6b`
three times (the first compiles), timing `ModelRunner._run_forward` of every decode step, the
second time with the device idle before each call ("sync"). Prints the medians.
"""

import random
import sys
import time

import jax
import numpy as np

from jaxllm import LLM, SamplingParams

llm = LLM("random:qwen3-0.6b", compile_at_startup=False)
runner = llm.engine.runner
original = runner._run_forward
times = {"async": [], "sync": []}
mode = ["async"]


def timed(bucket, arrays, previous_tokens):
    if mode[0] == "sync":
        jax.block_until_ready(runner.kv_cache)
    start = time.perf_counter()
    out = original(bucket, arrays, previous_tokens)
    if bucket[0] == "decode":
        times[mode[0]].append(time.perf_counter() - start)
    return out


runner._run_forward = timed
random.seed(0)
prompts = [[random.randint(0, 10000) for _ in range(500)] for _ in range(256)]
params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=150)
for m in ("async", "sync", "async"):
    mode[0] = m
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(m, f"{time.perf_counter() - start:.2f} s", flush=True)
for m, t in times.items():
    median, least = 1e3 * np.median(t), 1e3 * min(t)
    print(f"{sys.argv[1]} forward call, {m}: median {median:.3f} ms, min {least:.3f} ms")
print(llm.last_run_stats)
