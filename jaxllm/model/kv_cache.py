"""The paged KV cache: one keys array and one values array, each for every layer.

Each is `[L, NB, BS, K, H]`: layer, block, offset in the block, kv head, head dim. A token's flat
slot is `block_id * BS + offset`. Keys and values are two arrays rather than one `[L, 2, ...]`
array because paged attention kernels (FlashAttention-3) take them as two operands of shape
`[blocks, BS, K, H]`: `keys.reshape(L * NB, BS, K, H)` is free (a bitcast), with layer `l`'s
block `b` at `l * NB + b`, while a slice of a combined array would be copied at every layer.

Legend: L layers, NB blocks, BS block size, K kv heads, H head dim, T tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxllm.model.config import Qwen3Config


@struct.dataclass
class KVCache:
    """The whole paged cache (a pytree of two arrays, donated to every step).

    Attributes:
        keys: [L, NB, BS, K, H].
        values: [L, NB, BS, K, H].
    """

    keys: jax.Array
    values: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    def layer_views(self) -> tuple[jax.Array, jax.Array]:
        """Keys and values as `[L * NB, BS, K, H]` block pools (free reshapes, no copy)."""
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = self.keys.shape
        shape = (num_layers * num_blocks, block_size, num_kv_heads, head_dim)
        return self.keys.reshape(shape), self.values.reshape(shape)


def kv_cache_shape(config: Qwen3Config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The shape `(L, NB, BS, K, H)` of the keys array (and of the values array)."""
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    return (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)


def kv_cache_bytes_per_block(
    config: Qwen3Config, block_size: int, dtype: jnp.dtype | str | None = None
) -> int:
    """Device bytes one block takes across all layers (to size the pool from free memory)."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * itemsize


def allocate_kv_cache(
    config: Qwen3Config, num_blocks: int, block_size: int, dtype: jnp.dtype | str | None = None
) -> KVCache:
    """A zeroed cache on the default device (dtype: the config's)."""
    shape = kv_cache_shape(config, num_blocks, block_size)
    dtype = dtype or config.jnp_dtype
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write_kv(
    kv_cache: KVCache, layer: jax.Array | int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Scatters the new tokens' keys and values into one layer of the cache.

    Args:
        kv_cache: the cache, updated in place under jit when donated.
        layer: the layer index (a traced scalar inside the layer scan).
        k, v: [T, K, H] the new tokens' keys and values.
        slot_mapping: [T] flat slots; negative slots (padding) write nowhere.

    Returns:
        The updated cache.
    """
    num_blocks, block_size = kv_cache.num_blocks, kv_cache.block_size
    # NOTE: JAX wraps negative indices, so padding slots are moved past the end and dropped.
    slots = jnp.where(slot_mapping < 0, num_blocks * block_size, slot_mapping)
    block_ids, offsets = slots // block_size, slots % block_size  # [T], [T]
    keys = kv_cache.keys.at[layer, block_ids, offsets].set(
        k.astype(kv_cache.keys.dtype), mode="drop"
    )
    values = kv_cache.values.at[layer, block_ids, offsets].set(
        v.astype(kv_cache.values.dtype), mode="drop"
    )
    return KVCache(keys, values)
