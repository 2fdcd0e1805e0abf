"""What a host callback costs inside a program of several steps on this device:
`python scripts/callback_time.py [--steps 8] [--rows 1 8] [--runs 30]`.

A `fori_loop` of `--steps` steps, each a chain of matmuls over a [rows, 1024] activation (about
a small model's decode step of work) and an argmax over 151,936 logits, run with and without an
`io_callback` per step that takes the step's tokens to the host and returns a [rows, 4,748]
int32 token bitmask, applied to the next step's logits (a structured output's mask, filled on
the host while the device waits). Prints the median ms per step of each, and the difference.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

VOCAB = 151_936
WORDS = -(-VOCAB // 32)
DIM = 1024


def step_program(num_steps: int, callback: bool):
    def host_mask(tokens: np.ndarray) -> np.ndarray:
        return np.full((tokens.shape[0], WORDS), -1, np.int32)

    @jax.jit
    def run(weights, head, x):
        rows = x.shape[0]

        def body(j, carry):
            x, mask, tokens = carry
            h = x
            for w in weights:
                h = jnp.tanh(h @ w)
            logits = (h @ head).astype(jnp.float32)
            bits = (mask[:, jnp.arange(VOCAB) // 32] >> (jnp.arange(VOCAB) % 32)) & 1
            token = jnp.argmax(jnp.where(bits > 0, logits, -jnp.inf), axis=-1).astype(jnp.int32)
            if callback:
                shape = jax.ShapeDtypeStruct((rows, WORDS), jnp.int32)
                mask = io_callback(host_mask, shape, token, ordered=True)
            return h, mask, tokens.at[j].set(token)

        mask = jnp.full((rows, WORDS), -1, jnp.int32)
        tokens = jnp.zeros((num_steps, rows), jnp.int32)
        return jax.lax.fori_loop(0, num_steps, body, (x, mask, tokens))[2]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    key = jax.random.key(0)
    weights = [
        jax.random.normal(k, (DIM, DIM), jnp.bfloat16) / 32
        for k in jax.random.split(key, 4 * args.layers)
    ]
    head = jax.random.normal(key, (DIM, VOCAB), jnp.bfloat16) / 32
    print(f"{jax.devices()[0].device_kind}: {args.steps} steps a program, ms per step (median)")
    print(f"{'rows':>5} {'no callback':>12} {'callback':>10} {'difference':>11}")
    for rows in args.rows:
        x = jnp.ones((rows, DIM), jnp.bfloat16)
        times = {}
        for callback in (False, True):
            run = step_program(args.steps, callback)
            jax.block_until_ready(run(weights, head, x))
            samples = []
            for _ in range(args.runs):
                start = time.perf_counter()
                jax.block_until_ready(run(weights, head, x))
                samples.append((time.perf_counter() - start) / args.steps)
            times[callback] = 1e3 * float(np.median(samples))
        without, with_ = times[False], times[True]
        print(f"{rows:5d} {without:12.3f} {with_:10.3f} {with_ - without:11.3f}")


if __name__ == "__main__":
    main()
