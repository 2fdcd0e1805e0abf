"""Matmuls of a few rows as one Pallas (Triton) kernel each: the projections of small decode steps.

At a few rows a projection only reads its weights; XLA runs it as a GEMM (or a reduction) and
a split-K sum, two kernels well below the memory's rate (docs/performance.md). Here one
program computes `block_n` output columns over a `splits`-th of the inputs, enough programs to
fill the GPU; with several splits XLA sums their float32 partials inside whatever reads them.
Off a GPU it runs interpreted (tests).

Legend: M rows (at most `MAX_ROWS`, padded to a power of two >= 16), K inputs, N outputs,
S splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The most rows a kernel takes; from 64, cuBLAS (`Kernels.cublas_from_rows`).
MAX_ROWS = 32
# Output columns and inputs a program reads at a time: [BLOCK_K, BLOCK_N] bf16 is 8 KB.
BLOCK_N, BLOCK_K = 32, 128
# Programs to aim for (an H200 has 132 multiprocessors).
TARGET_PROGRAMS = 128
NUM_WARPS, NUM_STAGES = 4, 3


def splits_for(
    in_features: int, out_features: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K
) -> int | None:
    """Splits of the inputs: the fewest (a power of two) that make `TARGET_PROGRAMS`
    programs, each a whole number of `block_k` inputs; None where the kernel takes no such
    shape (outputs not a multiple of `block_n`, inputs not of `block_k`)."""
    if out_features % block_n or in_features % block_k:
        return None
    splits = 1
    while (
        out_features // block_n * splits < TARGET_PROGRAMS
        and in_features % (2 * splits * block_k) == 0
    ):
        splits *= 2
    return splits


def _kernel(x_ref, w_ref, o_ref, *, block_k: int):
    """x [M, K / S], w [K / S, BN] -> o [M, BN]: one program's columns over its inputs,
    accumulated in float32."""

    def body(step, acc):
        k = pl.multiple_of(step * block_k, block_k)
        return acc + plgpu.dot(x_ref[:, pl.ds(k, block_k)], w_ref[pl.ds(k, block_k), :])

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = lax.fori_loop(0, x_ref.shape[1] // block_k, body, acc).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "out_dtype", "block_n", "block_k", "splits", "num_warps", "num_stages", "interpret"
    ),
)  # fmt: skip
def small_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype: jnp.dtype,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in `out_dtype`, accumulated in float32.

    Args:
        x, w: M <= `MAX_ROWS`, and a shape `splits_for` takes.
        block_n, block_k, splits, num_warps, num_stages, interpret: the tiling (splits:
            `splits_for`'s by default), Triton's launch settings, and Pallas' interpreter.
    """
    rows, in_features = x.shape
    out_features = w.shape[1]
    splits = splits or splits_for(in_features, out_features, block_n, block_k)
    if rows > MAX_ROWS or splits is None or in_features % (splits * block_k):
        raise ValueError(f"no small matmul of {rows} rows x [{in_features}, {out_features}]")
    padded = max(16, pl.next_power_of_2(rows))  # Triton's dots take 16 rows at least
    part = in_features // splits
    partial = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k),
        grid=(out_features // block_n, splits),
        in_specs=[
            pl.BlockSpec((padded, part), lambda j, s: (0, s)),
            pl.BlockSpec((part, block_n), lambda j, s: (s, j)),
        ],
        out_specs=pl.BlockSpec((None, padded, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct(
            (splits, padded, out_features), out_dtype if splits == 1 else jnp.float32
        ),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxllm_small_matmul",
    )(jnp.pad(x, ((0, padded - rows), (0, 0))), w)
    if splits == 1:
        return partial[0, :rows]
    return partial[:, :rows].sum(axis=0).astype(out_dtype)
