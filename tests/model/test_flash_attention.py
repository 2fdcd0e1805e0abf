"""FlashAttention-3 (the "flash" backend) against the portable reference, on a GPU.

Skipped on CPU (`gpu` marker); run on the H200 with `python -m pytest -q -m gpu tests`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model.attention import get_attention_backend
from jaxllm.model.checkpoint import load_params
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.qwen3 import forward

from .helpers import Chunk, build_inputs

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 256


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def random_chunks(rng, count: int, max_start: int, max_new: int, num_blocks: int):
    """Chunks over random, scattered block tables: `start` cached tokens plus new ones."""
    blocks = rng.permutation(num_blocks).tolist()
    chunks = []
    for _ in range(count):
        start = int(rng.integers(0, max_start + 1))
        new = int(rng.integers(1, max_new + 1))
        needed = -(-(start + new) // BLOCK_SIZE)
        table, blocks = blocks[:needed], blocks[needed:]
        chunks.append(Chunk(rng.integers(0, 1000, new).tolist(), start, table))
    return chunks


@pytest.mark.parametrize(
    ("tile_size", "count", "max_start", "max_new"),
    [(1, 64, 2000, 1), (128, 8, 1500, 600)],
    ids=["decode", "prefill-over-cached-context"],
)
def test_flash_matches_reference_attention(tile_size, count, max_start, max_new):
    from jaxllm.model import flash_attention

    if not flash_attention.flash_available():
        pytest.skip("flash-attn3-jax is not installed")
    rng = np.random.default_rng(0)
    num_blocks = 1024
    chunks = random_chunks(rng, count, max_start, max_new, num_blocks)
    inputs = build_inputs(chunks, BLOCK_SIZE, tile_size, table_width=16)
    num_heads, num_kv_heads, head_dim = 16, 8, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (inputs.token_ids.shape[0], num_heads, head_dim), jnp.bfloat16)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = jax.random.normal(keys[1], shape, jnp.bfloat16)
    v_cache = jax.random.normal(keys[2], shape, jnp.bfloat16)

    flash = jax.jit(get_attention_backend("flash"))(q, k_cache, v_cache, inputs)
    reference = jax.jit(get_attention_backend("reference"))(q, k_cache, v_cache, inputs)

    real_rows = np.asarray(inputs.slot_mapping) >= 0
    flash, reference = np.asarray(flash)[real_rows], np.asarray(reference)[real_rows]
    row_errors = [relative_error(f, r) for f, r in zip(flash, reference, strict=True)]
    worst = int(np.argmax(row_errors))
    assert relative_error(flash, reference) < 1e-2, (
        f"worst row {worst}: error {row_errors[worst]:.3g}, "
        f"context {np.asarray(inputs.context_lens)[worst]}, errors {np.round(row_errors, 4)}"
    )


def test_flash_model_logits_match_reference_in_bfloat16():
    from jaxllm.model import flash_attention

    if not flash_attention.flash_available():
        pytest.skip("flash-attn3-jax is not installed")
    config, params = load_params("random:qwen3-0.6b", dtype="bfloat16")
    rng = np.random.default_rng(1)
    num_blocks = 64
    prompts = random_chunks(rng, 4, 0, 700, num_blocks)
    prompts = [Chunk(c.token_ids, 0, c.block_table) for c in prompts]
    prefill = build_inputs(prompts, BLOCK_SIZE, 128, table_width=8, sample_all=False)
    step = jax.jit(forward, static_argnums=1, donate_argnums=2)

    logits = {}
    for backend in ("reference", "flash"):
        cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE)
        model = config.replace(attention_backend=backend)
        prefill_logits, cache = step(params, model, cache, prefill)
        # One decode step on top of the prefilled prompts.
        tokens = np.asarray(jnp.argmax(prefill_logits, axis=-1))
        decode = build_inputs(
            [
                Chunk([int(t)], len(c.token_ids), c.block_table)
                for c, t in zip(prompts, tokens, strict=True)
            ],
            BLOCK_SIZE,
            1,
            table_width=8,
        )
        decode_logits, cache = step(params, model, cache, decode)
        logits[backend] = (np.asarray(prefill_logits), np.asarray(decode_logits))

    errors = [
        relative_error(flash, reference)
        for flash, reference in zip(logits["flash"], logits["reference"], strict=True)
    ]
    assert max(errors) < 1e-2, f"prefill, decode logits relative errors: {errors}"
