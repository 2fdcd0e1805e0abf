"""What a host callback costs inside a loop of decode steps: each step of a `fori_loop` draws a
token on the device, hands it to the host (`jax.experimental.io_callback`), and takes back a
token bitmask [rows, ceil(V / 32)] for the next step's draw, as a constrained row's grammar
would give it. Timed against the same loop with the mask held on the device; the difference
per step is the callback's cost.

    python scripts/callback_cost.py [--steps 64] [--rows 1] [--width 1024]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxllm.research.flags import at_least

VOCAB = 151_936
WORDS = -(-VOCAB // 32)


def loop(weights, embed, mask, steps: int, callback: bool):
    """`steps` draws: logits of the hidden state, masked by the bitmask; the drawn token's
    embedding feeds the next step."""

    def host_mask(tokens):
        out = np.full((tokens.shape[0], WORDS), -1, np.int32)
        out[:, 0] ^= 1 << (tokens % 31).astype(np.int32)  # a mask that depends on the token
        return out

    def body(_, carry):
        hidden, mask, tokens = carry
        hidden = jnp.tanh(hidden @ weights)
        logits = hidden @ embed.T
        bits = (mask[:, jnp.arange(VOCAB) // 32] >> (jnp.arange(VOCAB) % 32)) & 1
        token = jnp.argmax(jnp.where(bits == 1, logits, -jnp.inf), axis=-1).astype(jnp.int32)
        if callback:
            shape = jax.ShapeDtypeStruct(mask.shape, jnp.int32)
            mask = io_callback(host_mask, shape, token, ordered=True)
        return embed[token], mask, tokens + token

    hidden = embed[jnp.zeros(mask.shape[0], jnp.int32)]
    return jax.lax.fori_loop(0, steps, body, (hidden, mask, jnp.zeros(mask.shape[0], jnp.int32)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=at_least(1), default=64)
    parser.add_argument("--rows", type=at_least(1), default=1)
    parser.add_argument("--width", type=at_least(1), default=1024)
    parser.add_argument("--repeat", type=at_least(1), default=20)
    args = parser.parse_args(argv)
    key = jax.random.key(0)
    weights = jax.random.normal(key, (args.width, args.width), jnp.bfloat16) / args.width**0.5
    embed = jax.random.normal(key, (VOCAB, args.width), jnp.bfloat16)
    mask = jnp.full((args.rows, WORDS), -1, jnp.int32)
    record = {"device": jax.devices()[0].device_kind, "steps": args.steps, "rows": args.rows}
    for callback in (False, True):
        run = jax.jit(functools.partial(loop, steps=args.steps, callback=callback))
        jax.block_until_ready(run(weights, embed, mask))
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            jax.block_until_ready(run(weights, embed, mask))
            times.append(time.perf_counter() - start)
        record["with_callback" if callback else "without"] = {
            "ms_per_step_p50": 1e3 * float(np.median(times)) / args.steps,
            "ms_per_step_min": 1e3 * float(np.min(times)) / args.steps,
        }
    record["callback_ms_per_step"] = (
        record["with_callback"]["ms_per_step_p50"] - record["without"]["ms_per_step_p50"]
    )
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
