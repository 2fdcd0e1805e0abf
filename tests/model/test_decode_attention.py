"""jaxllm's Pallas decode kernel (the "pallas" backend) against the portable reference: in
float32 through Pallas' interpreter on any machine, and compiled (Triton) in bf16 on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import relative_error

from jaxllm.model.attention import reference_attention
from jaxllm.model.decode_attention import num_programs_for, paged_decode_attention
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
    ("heads", "kv_heads", "head_dim", "block_size", "programs"),
    [
        (16, 8, 128, 32, 1),
        (16, 8, 128, 32, 3),
        (16, 8, 128, 32, 200),
        (8, 4, 64, 16, 64),
        (4, 1, 64, 64, 2),
    ],
    # NOTE: with a tile a program, the longest sequence has more segments than a merge
    # program takes at once.
    ids=["gqa2-one-program", "gqa2", "a-tile-a-program", "small-heads", "one-kv-head"],
)
def test_kernel_equals_reference_in_float32(heads, kv_heads, head_dim, block_size, programs):
    rng = np.random.default_rng(0)
    q, keys, values, inputs = decode_case(rng, 6, heads, kv_heads, head_dim, block_size, 4, "f4")
    out = paged_decode_attention(
        q, keys, values, inputs.block_tables, inputs.context_lens,
        num_programs=programs, interpret=True,
    )  # fmt: skip
    expected = reference_attention(q, keys, values, inputs)
    real = np.asarray(inputs.context_lens) > 0
    assert relative_error(np.asarray(out)[real], np.asarray(expected)[real]) < 1e-5
    assert not np.asarray(out)[~real].any()  # no context: zeros, not NaN


@pytest.mark.parametrize("empty", [[2, 3, 7], list(range(9))], ids=["some", "all"])
def test_programs_cross_sequences_with_no_context(empty):
    """Programs whose ranges span several sequences, some of them empty (padding rows)."""
    rng = np.random.default_rng(2)
    q, keys, values, inputs = decode_case(rng, 9, 16, 8, 128, 32, 4, "f4")
    lengths = np.asarray(inputs.context_lens).copy()
    lengths[empty] = 0
    inputs = inputs._replace(context_lens=jnp.asarray(lengths))
    out = paged_decode_attention(
        q, keys, values, inputs.block_tables, inputs.context_lens, num_programs=5, interpret=True
    )
    out = np.asarray(out)
    expected = np.asarray(reference_attention(q, keys, values, inputs))
    real = lengths > 0
    if real.any():
        assert relative_error(out[real], expected[real]) < 1e-5
    assert not out[~real].any()


@pytest.mark.gpu
def test_compiled_kernel_equals_reference_in_bfloat16():
    rng = np.random.default_rng(1)
    q, keys, values, inputs = decode_case(rng, 64, 16, 8, 128, 256, 16, jnp.bfloat16)
    expected = jax.jit(reference_attention)(q, keys, values, inputs)
    real = np.asarray(inputs.context_lens) > 0
    for programs in (num_programs_for(132), 7):
        out = paged_decode_attention(
            q, keys, values, inputs.block_tables, inputs.context_lens, num_programs=programs
        )  # fmt: skip
        assert relative_error(np.asarray(out)[real], np.asarray(expected)[real]) < 1e-2
        assert not np.asarray(out)[~real].any()
