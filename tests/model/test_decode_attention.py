"""jaxllm's Pallas decode kernel (the "pallas" backend) against the portable reference: in
float32 through Pallas' interpreter on any machine, and compiled (Triton) in bf16 on a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import relative_error

from jaxllm.model.attention import reference_attention
from jaxllm.model.decode_attention import (
    BALANCED_FROM_SEQUENCES,
    balanced_decode_attention,
    num_programs_for,
    num_splits_for,
    paged_decode_attention,
    split_decode_attention,
)
from jaxllm.model.inputs import ModelInputs


def decode_case(rng, batch, heads, kv_heads, head_dim, block_size, width, dtype):
    """Random queries, a pool with scattered blocks, and context lengths that include a full
    table, a single token and no context at all (a padding row)."""
    num_blocks = batch * width + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    keys = jnp.asarray(rng.standard_normal(shape), dtype)
    values = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((batch, heads, head_dim)), dtype)
    tables = rng.permutation(num_blocks)[: batch * width].reshape(batch, width).astype(np.int32)
    lengths = rng.integers(1, width * block_size + 1, batch).astype(np.int32)
    lengths[:3] = [width * block_size, 1, 0]
    inputs = ModelInputs(
        token_ids=jnp.zeros(batch, jnp.int32),
        positions=jnp.asarray(np.maximum(lengths - 1, 0)),
        slot_mapping=jnp.zeros(batch, jnp.int32),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(lengths),
        sample_indices=jnp.arange(batch, dtype=jnp.int32),
    )
    return q, keys, values, inputs


KERNELS = {"split": split_decode_attention, "balanced": balanced_decode_attention}


@pytest.mark.parametrize(
    ("kernel", "heads", "kv_heads", "head_dim", "block_size", "settings"),
    [
        ("split", 16, 8, 128, 32, dict(num_splits=1)),
        ("split", 16, 8, 128, 32, dict(num_splits=3)),
        ("split", 8, 4, 64, 16, dict(num_splits=2)),
        ("split", 4, 1, 64, 64, dict(num_splits=1)),
        ("balanced", 16, 8, 128, 32, dict(num_programs=1)),
        ("balanced", 16, 8, 128, 32, dict(num_programs=3)),
        ("balanced", 16, 8, 128, 32, dict(num_programs=200)),
        ("balanced", 8, 4, 64, 16, dict(num_programs=64)),
        ("balanced", 4, 1, 64, 64, dict(num_programs=2)),
    ],
    # NOTE: with a tile a program, the longest sequence has more segments than a merge
    # program takes at once.
    ids=[
        *("split-gqa2", "split-gqa2-3", "split-small-blocks", "split-one-kv-head"),
        *("balanced-one-program", "balanced-gqa2", "balanced-a-tile-a-program"),
        *("balanced-small-heads", "balanced-one-kv-head"),
    ],
)
def test_kernels_equal_reference_in_float32(
    kernel, heads, kv_heads, head_dim, block_size, settings
):
    rng = np.random.default_rng(0)
    q, keys, values, inputs = decode_case(rng, 6, heads, kv_heads, head_dim, block_size, 4, "f4")
    tables, lengths = inputs.block_tables, inputs.context_lens
    out = KERNELS[kernel](q, keys, values, tables, lengths, interpret=True, **settings)
    expected = reference_attention(q, keys, values, inputs)
    real = np.asarray(inputs.context_lens) > 0
    assert relative_error(np.asarray(out)[real], np.asarray(expected)[real]) < 1e-5
    assert not np.asarray(out)[~real].any()  # no context: zeros, not NaN


@pytest.mark.parametrize("empty", [[2, 3, 7], list(range(9))], ids=["some", "all"])
def test_balanced_programs_cross_sequences_with_no_context(empty):
    """Programs whose ranges span several sequences, some of them empty (padding rows)."""
    rng = np.random.default_rng(2)
    q, keys, values, inputs = decode_case(rng, 9, 16, 8, 128, 32, 4, "f4")
    lengths = np.asarray(inputs.context_lens).copy()
    lengths[empty] = 0
    inputs = inputs._replace(context_lens=jnp.asarray(lengths))
    out = balanced_decode_attention(
        q, keys, values, inputs.block_tables, inputs.context_lens, num_programs=5, interpret=True
    )
    out = np.asarray(out)
    expected = np.asarray(reference_attention(q, keys, values, inputs))
    real = lengths > 0
    if real.any():
        assert relative_error(out[real], expected[real]) < 1e-5
    assert not out[~real].any()


def test_splits_fill_the_gpu_for_small_batches():
    assert num_splits_for(256, 16, 256, 8, 512) == 2
    assert num_splits_for(16, 16, 256, 8, 512) == 32
    assert num_splits_for(8, 16, 256, 8, 512) == 64
    assert num_splits_for(8, 2, 256, 8, 512) == 16  # each split at least 4 tiles of the table
    assert num_splits_for(1, 1, 16, 1, 512) == 1  # a one-tile table is never split
    assert num_splits_for(1, 3, 32, 8, 512) == 2  # 12 tiles: 3 splits of 4, down to a power of two


@pytest.mark.parametrize(
    ("batch", "kernel"),
    [(BALANCED_FROM_SEQUENCES - 1, "paged_decode"), (BALANCED_FROM_SEQUENCES, "balanced_decode")],
)
def test_the_balanced_kernel_takes_large_batches(batch, kernel):
    """From BALANCED_FROM_SEQUENCES the balanced kernel, on half the split kernel's programs."""
    splits = num_splits_for(batch, 16, 256, 8, 528)
    grid = (264,) if kernel == "balanced_decode" else (batch, splits)
    q = jax.ShapeDtypeStruct((batch, 16, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64, 256, 8, 128), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((batch, 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    attention = functools.partial(paged_decode_attention, num_programs=528)
    jaxpr = str(jax.make_jaxpr(attention)(q, pool, pool, tables, lengths))
    assert f"jaxllm_{kernel}" in jaxpr
    assert f"GridMapping(grid={grid}" in jaxpr


@pytest.mark.gpu
def test_compiled_kernels_equal_reference_in_bfloat16():
    rng = np.random.default_rng(1)
    q, keys, values, inputs = decode_case(rng, 64, 16, 8, 128, 256, 16, jnp.bfloat16)
    expected = jax.jit(reference_attention)(q, keys, values, inputs)
    real = np.asarray(inputs.context_lens) > 0
    tables, lengths = inputs.block_tables, inputs.context_lens
    for out in (
        jax.jit(split_decode_attention)(q, keys, values, tables, lengths),
        *[
            jax.jit(functools.partial(balanced_decode_attention, num_programs=n))(
                q, keys, values, tables, lengths
            )
            for n in (num_programs_for(132), 7)
        ],
    ):
        assert relative_error(np.asarray(out)[real], np.asarray(expected)[real]) < 1e-2
        assert not np.asarray(out)[~real].any()
