"""Matmuls of a few rows (decode at small batches) on the GPU: XLA's beside jaxllm's Pallas
kernel (`jaxllm.model.matmul_kernel`).

    python scripts/skinny_gemm.py [--rows 8 1 16 32] [--sweep]

qwen3-0.6b's four projections (q/k/v 1024 -> 4096, o 2048 -> 1024, gate/up 1024 -> 6144, down
3072 -> 1024), bf16 weights [in, out] as the engine keeps them, 28 layers of distinct weights
(840 MB, beyond L2). A case is one jitted function of 28 calls of one shape, each on its own
input, or (`chain`) 28 layers of the four, each on the output before, as a decode step runs
them; its time is the median of 20 host-timed runs. Prints us per call (per layer for a chain)
and the weights' read rate; `--sweep` tries tilings (columns, inputs per loop step, splits) at
the first `--rows` and keeps each shape's best for the others.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
from decode_step import timed  # scripts/decode_step.py

from jaxllm.model.matmul_kernel import small_matmul

LAYERS = 28
SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}
# The dtype each projection's output takes in the model (o and down add to the f32 stream).
OUT_DTYPES = {"qkv": jnp.bfloat16, "o": jnp.float32, "gate_up": jnp.bfloat16, "down": jnp.float32}


def xla_matmul(x, w, *, out_dtype):
    return jnp.dot(x, w, preferred_element_type=out_dtype)


def one_shape(matmul, weights, xs):
    return [matmul(x, w) for x, w in zip(xs, weights, strict=True)]


def chain(matmuls, weights, x):
    for layer in range(len(weights["qkv"])):
        qkv = matmuls["qkv"](x, weights["qkv"][layer])
        o = matmuls["o"](qkv[:, :2048], weights["o"][layer]).astype(jnp.bfloat16)
        gate_up = matmuls["gate_up"](o, weights["gate_up"][layer])
        hidden = jax.nn.silu(gate_up[:, :3072]) * gate_up[:, 3072:]
        x = matmuls["down"](hidden, weights["down"][layer]).astype(jnp.bfloat16)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 1, 16, 32])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--interpret", action="store_true", help="check it on a CPU (2 layers)")
    args = parser.parse_args()
    layers = 2 if args.interpret else LAYERS
    keys = map(functools.partial(jax.random.fold_in, jax.random.key(0)), itertools.count())
    weights = {
        name: [jax.random.normal(next(keys), shape, jnp.bfloat16) * 0.03 for _ in range(layers)]
        for name, shape in SHAPES.items()
    }
    tilings = {name: {} for name in SHAPES}  # the kernel's own by default
    lines = []

    def report(rows, name, label, seconds, gb, extra=""):
        lines.append(
            f"{rows:>3} {name:<8} {label:<44} {seconds / layers * 1e6:7.1f} us "
            f"{gb / seconds / 1e3:5.2f} TB/s {extra}"
        )

    for rows in args.rows:
        for name, (size, out) in SHAPES.items():
            xs = [jax.random.normal(next(keys), (rows, size), jnp.bfloat16) for _ in range(layers)]
            gb = layers * size * out * 2 / 1e9
            xla = jax.jit(
                functools.partial(one_shape, functools.partial(xla_matmul, out_dtype=jnp.float32))
            )
            expected = xla(weights[name], xs)
            report(rows, name, "xla", timed(xla, weights[name], xs), gb)
            candidates = [tilings[name]]
            if args.sweep and rows == args.rows[0]:
                candidates += [
                    dict(block_n=n, block_k=k, splits=s)
                    for n, k, s in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8))
                    if size % (s * k) == 0
                ]
            best = None
            for tiling in candidates:
                matmul = functools.partial(
                    small_matmul, out_dtype=jnp.float32, interpret=args.interpret, **tiling
                )
                fn = jax.jit(functools.partial(one_shape, matmul))
                try:
                    got = fn(weights[name], xs)
                    seconds = timed(fn, weights[name], xs)
                except Exception as error:  # a tiling Triton refuses
                    lines.append(f"{rows:>3} {name:<8} {tiling} failed: {error!r:.200}")
                    continue
                err = max(float(jnp.abs(g - e).max()) for g, e in zip(got, expected, strict=True))
                if best is None or seconds < best[0]:
                    best = seconds, tiling
                if tiling is tilings[name]:
                    report(
                        rows,
                        name,
                        f"pallas {tiling or 'default'}",
                        seconds,
                        gb,
                        f"max err {err:.1e}",
                    )
            if best and best[1] is not tilings[name]:
                report(rows, name, f"best {best[1]}", best[0], gb)
                tilings[name] = best[1]
        x = jax.random.normal(next(keys), (rows, 1024), jnp.bfloat16)
        gb = layers * sum(size * out for size, out in SHAPES.values()) * 2 / 1e9
        for label, kernel, options in (
            ("xla", xla_matmul, {name: {} for name in SHAPES}),
            ("pallas", functools.partial(small_matmul, interpret=args.interpret), tilings),
        ):
            matmuls = {
                name: functools.partial(kernel, out_dtype=OUT_DTYPES[name], **options[name])
                for name in SHAPES
            }
            fn = jax.jit(functools.partial(chain, matmuls))
            report(rows, "chain", label, timed(fn, weights, x), gb)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
