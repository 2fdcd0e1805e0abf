"""The paged KV cache: one device array for every layer's keys and values.

Layout `[L, 2, NB, BS, K, H]`: layer, K/V (0 keys, 1 values), block, offset in the block, kv
head, head dim. A token's flat slot is `block_id * BS + offset`.

Legend: L layers, NB blocks, BS block size, K kv heads, H head dim, T tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model.config import Qwen3Config

KEYS, VALUES = 0, 1


def kv_cache_shape(config: Qwen3Config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The cache's shape `(L, 2, NB, BS, K, H)`."""
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    return (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)


def kv_cache_bytes_per_block(
    config: Qwen3Config, block_size: int, dtype: jnp.dtype | str | None = None
) -> int:
    """Device bytes one block takes across all layers (to size the pool from free memory)."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * itemsize


def allocate_kv_cache(
    config: Qwen3Config, num_blocks: int, block_size: int, dtype: jnp.dtype | str | None = None
) -> jax.Array:
    """A zeroed cache `[L, 2, NB, BS, K, H]` on the default device (dtype: the config's)."""
    shape = kv_cache_shape(config, num_blocks, block_size)
    return jnp.zeros(shape, dtype or config.jnp_dtype)


def write_kv(
    kv_cache: jax.Array, layer: jax.Array | int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Scatters the new tokens' keys and values into one layer of the cache.

    Args:
        kv_cache: [L, 2, NB, BS, K, H], updated in place under jit when donated.
        layer: the layer index (a traced scalar inside the layer scan).
        k, v: [T, K, H] the new tokens' keys and values.
        slot_mapping: [T] flat slots; negative slots (padding) write nowhere.

    Returns:
        The updated cache.
    """
    _, _, num_blocks, block_size, _, _ = kv_cache.shape
    # NOTE: JAX wraps negative indices, so padding slots are moved past the end and dropped.
    slots = jnp.where(slot_mapping < 0, num_blocks * block_size, slot_mapping)
    block_ids, offsets = slots // block_size, slots % block_size  # [T], [T]
    kv_cache = kv_cache.at[layer, KEYS, block_ids, offsets].set(
        k.astype(kv_cache.dtype), mode="drop"
    )
    return kv_cache.at[layer, VALUES, block_ids, offsets].set(v.astype(kv_cache.dtype), mode="drop")
