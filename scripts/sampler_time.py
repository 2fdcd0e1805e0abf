"""Times the sampler's program and the token mask's on this machine's first device: each sampler
mode with either argmax (`sampler.noisy_argmax`), each at the process's XLA flags and at XLA's
default optimization (`qwen3.DEFAULT_OPTIMIZATION`); median of `--repeat` runs, after one.

    python scripts/sampler_time.py [--rows 4 16 256] [--vocab 151936] [--modes random top-k]

With the tests' quick CPU flags: `XLA_FLAGS="--xla_backend_optimization_level=0
--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import steps
from jaxllm.model.inputs import SamplingInputs
from jaxllm.model.logits_processors import apply_bitmask
from jaxllm.model.qwen3 import DEFAULT_OPTIMIZATION
from jaxllm.sampling_params import SamplingParams

MODE_PARAMS = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.6),
    "top-k": dict(temperature=0.6, top_k=20, top_p=0.95),
    "filtered": dict(temperature=0.6, top_p=0.95),
}


def milliseconds(function, args, options, repeat: int) -> tuple[float, float]:
    """(compile, median run) milliseconds of `function` jitted with `options`."""
    start = time.perf_counter()
    compiled = jax.jit(function, compiler_options=options).lower(*args).compile()
    compile_ms = (time.perf_counter() - start) * 1e3
    jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        runs.append((time.perf_counter() - start) * 1e3)
    return compile_ms, statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 256])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--modes", nargs="+", default=["random", "top-k"], choices=MODE_PARAMS)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}, vocab {args.vocab}; ms: compile / run")
    print(f"{'program':<28}{'rows':>6}{'process flags':>18}{'default optimization':>24}")
    for rows in args.rows:
        logits = jnp.asarray(rng.normal(size=(rows, args.vocab)).astype(np.float32))
        programs = {}
        words = -(-args.vocab // 32)
        every_token = jnp.full((rows, words), -1, jnp.int32)
        for mode in args.modes:
            params = [SamplingParams(seed=row, **MODE_PARAMS[mode]) for row in range(rows)]
            packed = steps.pack(SamplingInputs.from_params(params, [0] * rows))
            for fused in (True, False):
                program = functools.partial(
                    steps.sample_step, num_rows=rows, mode=mode, fused_argmax=fused
                )
                name = f"sample {mode}, {'fused' if fused else 'max, index'}"
                programs[name] = (program, (logits, jnp.asarray(packed), every_token))
        bitmask = rng.integers(-(2**31), 2**31, (rows, words), dtype=np.int64).astype(np.int32)
        programs["token mask"] = (apply_bitmask, (logits, jnp.asarray(bitmask)))
        # The draw's floor: the same pass over the logits with no noise to make.
        programs["argmax of logits / T"] = (lambda x: jnp.argmax(x / 0.6, axis=-1), (logits,))
        for name, (program, program_args) in programs.items():
            cells = [
                "{:.0f} / {:.2f}".format(*milliseconds(program, program_args, options, args.repeat))
                for options in (None, DEFAULT_OPTIMIZATION)
            ]
            print(f"{name:<28}{rows:>6}{cells[0]:>18}{cells[1]:>24}")


if __name__ == "__main__":
    main()
