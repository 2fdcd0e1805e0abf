"""The reference attention backend against a dense computation, and the backend registry."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import Chunk, build_inputs

from jaxllm.model.attention import Kernels, reference_attention

pytestmark = pytest.mark.usefixtures("exact_float32_matmuls")

BLOCK_SIZE, NUM_BLOCKS, WIDTH = 8, 12, 3
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def dense_attention(q, k, v):
    """Causal softmax attention of one sequence: q [T, N, H], k/v [P, K, H] (last T keys new)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("TNH,PNH->NTP", q, k) / np.sqrt(q.shape[-1])
    query_positions = np.arange(k.shape[0] - q.shape[0], k.shape[0])
    scores = np.where(np.arange(k.shape[0]) <= query_positions[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("NTP,PNH->TNH", probs, v)


def test_reference_matches_dense_attention_per_sequence():
    rng = np.random.default_rng(0)
    k_cache = rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), np.float32)
    v_cache = rng.standard_normal(k_cache.shape, np.float32)
    # (context before, new tokens, block table): a prefill, a continued chunk and a decode.
    sequences = [(0, 5, [4, 9]), (6, 7, [0, 11]), (17, 1, [3, 1, 7])]
    chunks = [Chunk([1] * n, start, table) for start, n, table in sequences]
    inputs = build_inputs(chunks, BLOCK_SIZE, tile_size=4, table_width=WIDTH, num_tiles=7)
    q = rng.standard_normal((inputs.token_ids.shape[0], NUM_HEADS, HEAD_DIM), np.float32)

    out = np.asarray(reference_attention(jnp.asarray(q), k_cache, v_cache, inputs))

    rows = np.asarray(inputs.sample_indices)
    padding = np.setdiff1d(np.arange(len(q)), rows)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[padding[-4:]], 0.0)  # the all-padding tile
    row = 0
    for start, n, table in sequences:
        context = np.concatenate([k_cache[b] for b in table])[: start + n]
        values = np.concatenate([v_cache[b] for b in table])[: start + n]
        expected = dense_attention(q[rows[row : row + n]], context, values)
        np.testing.assert_allclose(out[rows[row : row + n]], expected, rtol=1e-5, atol=1e-5)
        row += n


def test_kernels_name_known_kernels_and_say_when_they_leave_xla():
    assert not Kernels().custom_calls
    assert Kernels("flash", "pallas").custom_calls and Kernels("reference", "flash").custom_calls
    with pytest.raises(ValueError, match=r"decode kernel must be one of .*'pallas'.*not 'flash3'"):
        Kernels(decode="flash3")
    with pytest.raises(ValueError, match=r"prefill kernel must be one of"):
        Kernels(prefill="pallas")  # the Pallas kernel decodes only
