"""The paged KV cache: writes at slots, padding slots, and in-place update under donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import Chunk, build_inputs, small_config

from jaxllm.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block, write_kv
from jaxllm.model.qwen3 import COMPILER_OPTIONS, forward, init_params

CONFIG = small_config()


def test_allocate_layout_and_bytes():
    cache = allocate_kv_cache(CONFIG, num_blocks=5, block_size=8, dtype=jnp.bfloat16)
    for array in (cache.keys, cache.values):
        assert array.shape == (3, 5, 8, 1, 16) and array.dtype == jnp.bfloat16
    assert kv_cache_bytes_per_block(CONFIG, 8, jnp.bfloat16) * 5 == 2 * cache.keys.nbytes


@pytest.mark.parametrize("block_size", [0, 4, 12, 24])
def test_block_size_must_be_a_power_of_two_of_at_least_8(block_size):
    with pytest.raises(ValueError, match="power of two"):
        allocate_kv_cache(CONFIG, num_blocks=2, block_size=block_size)


def test_write_lands_at_layer_block_offset_and_padding_writes_nowhere():
    cache = allocate_kv_cache(CONFIG, num_blocks=4, block_size=8)
    k = jnp.arange(1, 4, dtype=jnp.float32)[:, None, None] * jnp.ones((3, 1, 16))
    v = -k
    slots = jnp.array([3 * 8 + 5, -1, 0 * 8 + 7], jnp.int32)

    cache = jax.jit(write_kv)(cache, 1, k, v, slots)

    expected_keys = np.zeros(cache.keys.shape, np.float32)
    expected_keys[1, 3, 5], expected_keys[1, 0, 7] = 1.0, 3.0
    np.testing.assert_array_equal(np.asarray(cache.keys), expected_keys)
    np.testing.assert_array_equal(np.asarray(cache.values), -expected_keys)


def test_many_padding_rows_write_nowhere():
    """More padding rows than a block has slots: each is sent past the end on its own."""
    cache = allocate_kv_cache(CONFIG, num_blocks=2, block_size=8)
    k = jnp.arange(1, 41, dtype=jnp.float32)[:, None, None] * jnp.ones((40, 1, 16))
    slots = jnp.full((40,), -1, jnp.int32).at[7].set(9).at[31].set(0)

    cache = jax.jit(write_kv)(cache, 0, k, -k, slots)

    expected_keys = np.zeros(cache.keys.shape, np.float32)
    expected_keys[0, 1, 1], expected_keys[0, 0, 0] = 8.0, 32.0
    np.testing.assert_array_equal(np.asarray(cache.keys), expected_keys)
    np.testing.assert_array_equal(np.asarray(cache.values), -expected_keys)


def test_jitted_forward_updates_the_donated_cache_in_place():
    params = init_params(CONFIG, seed=0)
    cache = allocate_kv_cache(CONFIG, num_blocks=256, block_size=16)
    inputs = build_inputs([Chunk([1, 2, 3, 4, 5], 0, [7])], 16, tile_size=4, table_width=2)
    step = jax.jit(forward, static_argnums=1, donate_argnums=2, compiler_options=COMPILER_OPTIONS)
    pointers = [array.unsafe_buffer_pointer() for array in (cache.keys, cache.values)]
    compiled = step.lower(params, CONFIG, cache, inputs).compile()

    _, new_cache = step(params, CONFIG, cache, inputs)

    assert cache.keys.is_deleted() and cache.values.is_deleted()
    assert [a.unsafe_buffer_pointer() for a in (new_cache.keys, new_cache.values)] == pointers
    # No cache-sized temporary: neither a copy per layer nor a restacked cache.
    assert compiled.memory_analysis().temp_size_in_bytes < new_cache.keys.nbytes // 4
    for array in (new_cache.keys, new_cache.values):
        written = np.asarray(array[:, 7, :5])
        assert (np.abs(written).max(axis=(-1, -2)) > 0).all()
        assert np.count_nonzero(np.asarray(array)) == np.count_nonzero(written)
