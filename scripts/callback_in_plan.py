"""What a host callback per decode step costs inside the engine's own multi-step programs:
runs `scripts/bench.py` with each step of a plan taking its token bitmask from the host
(`jax.experimental.io_callback`, given the step's input tokens), as an exact path for
constrained rows would, in place of the bitmask the plan was given. The host's function
returns a mask of every token after `--host-us` microseconds of work (a grammar's step).

    python scripts/callback_in_plan.py [--host-us 100] -- <bench.py arguments>
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from jaxllm import steps
from jaxllm.model.inputs import ModelInputs, SamplingInputs
from jaxllm.model.logits_processors import apply_bitmask
from jaxllm.model.sampler import sample
from jaxllm.research.bench import main as bench_main
from jaxllm.startup import COMPILATION_CACHE_ENV

CALLS = []


def decode_steps_with_callback(host_us: float):
    def host_mask(tokens, words):
        start = time.perf_counter()
        mask = np.full((tokens.shape[0], words.shape[0]), -1, np.int32)
        while time.perf_counter() - start < host_us * 1e-6:
            pass
        CALLS.append(time.perf_counter() - start)
        return mask

    def decode_steps(
        forward_fn, params, kv_cache, packed, packed_sampling, bitmask, previous_tokens, *,
        bucket, mode, num_rows,
    ):  # fmt: skip
        *arrays, rows, slots = steps.unpack(packed, steps.padding_step(bucket))
        inputs = ModelInputs(*arrays)
        sampling = SamplingInputs(*steps.unpack(packed_sampling, bucket.padding()[1]))
        token_ids = jnp.where(rows >= 0, previous_tokens[jnp.maximum(rows, 0)], inputs.token_ids)
        words = jnp.zeros(bitmask.shape[1], jnp.int32)

        def step(j, carry):
            kv_cache, token_ids, tokens = carry
            shape = jax.ShapeDtypeStruct(bitmask.shape, jnp.int32)
            mask = io_callback(host_mask, shape, token_ids[: bitmask.shape[0]], words)
            step_inputs = inputs._replace(
                token_ids=token_ids,
                positions=inputs.positions + j,
                slot_mapping=slots[j],
                context_lens=jnp.where((slots[j] >= 0) | (j == 0), inputs.context_lens + j, 0),
            )
            logits, kv_cache = forward_fn(params, kv_cache, step_inputs)
            logits = apply_bitmask(logits, mask)
            sampled = sample(logits, sampling._replace(steps=sampling.steps + j), mode=mode)
            return kv_cache, sampled, tokens.at[j].set(sampled)

        tokens = jnp.zeros((bucket.num_steps, bucket.num_sampled), jnp.int32)
        carry = (kv_cache, token_ids, tokens)
        kv_cache, last, tokens = lax.fori_loop(0, bucket.num_steps, step, carry)
        padding = num_rows - bucket.num_sampled
        return jnp.pad(tokens, ((0, 0), (0, padding))), jnp.pad(last, (0, padding)), kv_cache

    return decode_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host-us", type=float, default=100.0)
    parser.add_argument("bench_args", nargs="*")
    args = parser.parse_args()
    steps.decode_steps = decode_steps_with_callback(args.host_us)
    # NOTE: no compilation cache: the patched program has the stored one's key
    os.environ[COMPILATION_CACHE_ENV] = ""
    code = bench_main(args.bench_args)
    if CALLS:
        print(f"callbacks: {len(CALLS)}, host work p50 {1e3 * np.median(CALLS):.3f} ms")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
