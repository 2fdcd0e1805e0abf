"""jaxllm's Pallas decode kernel (the "pallas" backend) against the portable reference: in
float32 through Pallas' interpreter on any machine, and compiled (Triton) in bf16 on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import relative_error

from jaxllm.model.attention import reference_attention
from jaxllm.model.decode_attention import num_splits_for, paged_decode_attention
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


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "splits"),
    [
        (16, 8, 128, 32, 1),
        (16, 8, 128, 32, 3),
        (8, 4, 64, 16, 2),
        (4, 1, 64, 64, 1),
    ],
    ids=["gqa2", "gqa2-split", "gqa2-small-blocks", "one-kv-head"],
)
def test_kernel_equals_reference_in_float32(heads, kv_heads, head_dim, block_size, splits):
    rng = np.random.default_rng(0)
    q, keys, values, inputs = decode_case(rng, 6, heads, kv_heads, head_dim, block_size, 4, "f4")
    out = paged_decode_attention(
        q,
        keys,
        values,
        inputs.block_tables,
        inputs.context_lens,
        num_splits=splits,
        interpret=True,
    )
    expected = reference_attention(q, keys, values, inputs)
    real = np.asarray(inputs.context_lens) > 0
    assert relative_error(np.asarray(out)[real], np.asarray(expected)[real]) < 1e-5
    assert not np.asarray(out)[~real].any()  # no context: zeros, not NaN


def test_splits_fill_the_gpu_for_small_batches():
    assert num_splits_for(256, 16, 256, 8) == 2
    assert num_splits_for(16, 16, 256, 8) == 32
    assert num_splits_for(8, 16, 256, 8) == 64
    assert num_splits_for(8, 2, 256, 8) == 16  # each split at least 4 tiles of the table
    assert num_splits_for(1, 1, 16, 1) == 1  # a one-tile table is never split
    assert num_splits_for(1, 3, 32, 8) == 2  # 12 tiles: 3 splits of 4, down to a power of two


@pytest.mark.gpu
def test_compiled_kernel_equals_reference_in_bfloat16():
    rng = np.random.default_rng(1)
    q, keys, values, inputs = decode_case(rng, 64, 16, 8, 128, 256, 16, jnp.bfloat16)
    out = jax.jit(paged_decode_attention)(q, keys, values, inputs.block_tables, inputs.context_lens)
    expected = jax.jit(reference_attention)(q, keys, values, inputs)
    real = np.asarray(inputs.context_lens) > 0
    assert relative_error(np.asarray(out)[real], np.asarray(expected)[real]) < 1e-2
