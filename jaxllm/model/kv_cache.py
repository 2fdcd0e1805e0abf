"""The paged KV cache: one keys array and one values array, each for every layer.

Each is `[L, NB, BS, K, H]`: layer, block, offset in the block, kv head, head dim. A token's flat
slot is `block_id * BS + offset`. Under tensor parallelism both are sharded on K
(`KV_CACHE_AXES`): each device holds the kv heads of its own query heads.
NOTE: two arrays, not one `[L, 2, ...]`: paged attention kernels take keys and values as two
`[blocks, BS, K, H]` operands, and `keys.reshape(L * NB, BS, K, H)` (layer `l`'s block `b` at
`l * NB + b`) is free where a slice of a combined array would be copied at every layer.

Legend: L layers, NB blocks, BS block size, K kv heads, H head dim, T tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from jaxllm.model.config import Qwen3Config
from jaxllm.model.sharding import check_tensor_parallel, logical_to_spec, tensor_parallel_size

# The logical axes of the keys and of the values arrays (see sharding.py).
KV_CACHE_AXES = ("layers", "blocks", "block_offset", "kv_heads", "head_dim")

# NOTE: a free gap below the KV cache for each step's small buffers (packed inputs, tokens, the
# structured outputs' token bitmask): carved above it they move the step's temporaries, and XLA
# re-records its CUDA graph, 1.5 ms of host time per qwen3-0.6b decode step on an H200 where
# replaying takes 0.6 (docs/performance.md). This much, and the runner's token bitmask.
SMALL_BUFFERS_BYTES = 2 << 20


@struct.dataclass
class KVCache:
    """The paged cache: `keys` and `values`, each [L, NB, BS, K, H] (a pytree donated to steps)."""

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


def kv_cache_bytes_per_block(
    config: Qwen3Config,
    block_size: int,
    dtype: jnp.dtype | str | None = None,
    tensor_parallel_size: int = 1,
) -> int:
    """Bytes one block takes on each device over all layers (sizes the pool from free memory)."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    kv_heads = config.num_kv_heads // tensor_parallel_size
    return config.num_layers * 2 * block_size * kv_heads * config.head_dim * itemsize


def kv_cache_specs() -> KVCache:
    """The cache's `PartitionSpec`s (a KVCache of two), for shard_map and shardings."""
    spec = logical_to_spec(KV_CACHE_AXES)
    return KVCache(spec, spec)


def allocate_kv_cache(
    config: Qwen3Config,
    num_blocks: int,
    block_size: int,
    dtype: jnp.dtype | str | None = None,
    mesh: Mesh | None = None,
) -> KVCache:
    """A zeroed cache (dtype: the config's) on the default device, or sharded over `mesh` on
    the kv heads, each device allocating only its own share. Under `jax.jit` (as the runner
    keeps it) a cache allocated again compiles nothing."""
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size}")
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if mesh is not None:
        check_tensor_parallel(config, tensor_parallel_size(mesh))
    shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    zeros = functools.partial(jnp.zeros, shape, dtype or config.jnp_dtype)
    shardings = None if mesh is None else _shardings(mesh)
    return jax.jit(lambda: KVCache(zeros(), zeros()), out_shardings=shardings)()


def _shardings(mesh: Mesh) -> KVCache:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), kv_cache_specs())


def kv_cache_shapes(config: Qwen3Config, num_blocks: int, block_size: int, mesh: Mesh) -> KVCache:
    """The cache `allocate_kv_cache(..., mesh=mesh)` makes, as `jax.ShapeDtypeStruct`s sharded
    over `mesh`; allocates nothing."""
    cache = jax.eval_shape(lambda: allocate_kv_cache(config, num_blocks, block_size))
    return jax.tree.map(lambda x, s: x.update(sharding=s), cache, _shardings(mesh))


def gap_bytes(max_sampled_rows: int, vocab_size: int) -> int:
    """The gap below the KV cache: `SMALL_BUFFERS_BYTES` and a token bitmask (vocab / 32 int32
    words) for each of the most rows a step samples."""
    return SMALL_BUFFERS_BYTES + 4 * max_sampled_rows * -(-vocab_size // 32)


def allocate_above_a_gap(
    allocate: Callable[[], KVCache], num_bytes: int, sharding: NamedSharding
) -> KVCache:
    """`allocate()`'s cache, placed above a free gap of `num_bytes` (the allocator fills the
    lowest free addresses first)."""
    gap = jax.device_put(np.zeros(num_bytes // 4, np.int32), sharding)
    kv_cache = allocate()
    gap.delete()
    return kv_cache


def write_kv(
    kv_cache: KVCache, layer: jax.Array | int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Scatters the new tokens' keys and values into layer `layer`; returns the updated cache
    (in place under jit when donated).

    Args:
        k, v: [T, K, H] the new tokens' keys and values.
        slot_mapping: [T] flat slots; negative slots (padding) write nowhere. The others must
            be distinct (the scheduler writes only into blocks a sequence owns alone).
    """
    num_blocks, block_size = kv_cache.num_blocks, kv_cache.block_size
    # NOTE: JAX wraps negative indices, so padding slots move past the end (each to its own) and
    # are dropped: distinct slots let XLA use plain stores, not a conflict-handling scatter.
    beyond = num_blocks * block_size + jnp.arange(slot_mapping.shape[0], dtype=slot_mapping.dtype)
    slots = jnp.where(slot_mapping < 0, beyond, slot_mapping)
    block_ids, offsets = slots // block_size, slots % block_size  # [T], [T]

    def scatter(cache: jax.Array, new: jax.Array) -> jax.Array:
        new = new.astype(cache.dtype)
        return cache.at[layer, block_ids, offsets].set(new, mode="drop", unique_indices=True)

    return KVCache(scatter(kv_cache.keys, k), scatter(kv_cache.values, v))
