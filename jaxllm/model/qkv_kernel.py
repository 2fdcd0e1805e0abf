"""The decode step's q/k RMSNorm, rotary embedding and KV-cache write as one Pallas kernel.

One program per token reads its row of the fused projection [K, G + 2, H] once, writes its
normalised, rotated queries, and writes its key and value into the cache in place (aliased to
the output), all in float32 rounded once. Used by the "pallas" backend's decode steps
(`layers.Attention`); off a GPU it runs interpreted (tests).
NOTE: XLA:GPU runs these as six small kernels per layer, longer than the q/k/v GEMM
(docs/performance.md).

Legend: T tokens, K kv heads, G query heads per kv head, H head dim, L layers, NB blocks,
BS block size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.model.kv_cache import KVCache


def kernel_fits(num_kv_heads: int, group: int, head_dim: int) -> bool:
    """Whether the kernel takes this shape: Triton's tiles are powers of two ([K, G, H / 2])."""
    return all(n & (n - 1) == 0 for n in (num_kv_heads, group, head_dim)) and head_dim >= 32


def _kernel(
    layer_ref,  # [1] the layer
    slot_ref,  # [1] this token's flat slot, -1 for padding
    qkv_ref,  # [K, G + 2, H] this token's projections
    q_scale_ref,  # [H]
    k_scale_ref,  # [H]
    cos_ref,  # [H]
    sin_ref,  # [H]
    k_cache_ref,  # [L * NB * BS, K, H] aliased to k_out_ref
    v_cache_ref,  # [L * NB * BS, K, H] aliased to v_out_ref
    q_out_ref,  # [K, G, H]
    k_out_ref,
    v_out_ref,
    *,
    group: int,
    slots_per_layer: int,
    eps: float,
):
    del k_cache_ref, v_cache_ref  # the same buffers as the outputs
    head_dim = qkv_ref.shape[-1]
    # NOTE: the rotation pairs the two halves of the head dim, so each is loaded on its own.
    halves = (pl.ds(0, head_dim // 2), pl.ds(head_dim // 2, head_dim // 2))
    f32 = jnp.float32
    cos, sin = (ref[halves[0]].astype(f32) for ref in (cos_ref, sin_ref))

    def norm_rope(heads, scale_ref) -> tuple[jax.Array, jax.Array]:
        """`qkv_ref[:, heads]` normalised over the head dim and rotated: two float32 halves."""
        first, second = (qkv_ref[:, heads, half].astype(f32) for half in halves)
        mean_square = (jnp.sum(first * first, -1) + jnp.sum(second * second, -1)) / head_dim
        inv = jax.lax.rsqrt(mean_square + eps)[..., None]
        first = first * inv * scale_ref[halves[0]].astype(f32)
        second = second * inv * scale_ref[halves[1]].astype(f32)
        return first * cos - second * sin, second * cos + first * sin

    def store(ref, index, values) -> None:
        for half, value in zip(halves, values, strict=True):
            ref[(*index, half)] = value.astype(ref.dtype)

    store(q_out_ref, (slice(None), slice(None)), norm_rope(pl.ds(0, group), q_scale_ref))
    slot = slot_ref[0]

    @pl.when(slot >= 0)
    def _write():
        row = layer_ref[0] * slots_per_layer + slot
        store(k_out_ref, (row, slice(None)), norm_rope(group, k_scale_ref))
        v_out_ref[row, :, :] = qkv_ref[:, group + 1, :].astype(v_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"), donate_argnums=(5,))
def norm_rope_write(
    qkv: jax.Array,
    q_scale: jax.Array,
    k_scale: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    kv_cache: KVCache,
    layer: jax.Array | int,
    slot_mapping: jax.Array,
    *,
    eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Normalises and rotates the queries and keys, and writes keys and values to the cache;
    returns the queries [T, K * G, H] in qkv's dtype, and the cache.

    Args:
        qkv: [T, K, G + 2, H] the fused projection: each kv head's G queries, key and value.
        q_scale, k_scale: [H] the q_norm and k_norm scales; eps: their RMSNorm epsilon.
        cos, sin: [T, H] float32 rotary tables (`layers.rotary_cos_sin`).
        kv_cache, layer, slot_mapping: the cache (donated, updated in place), the layer and
            [T] flat slots written (negative ones, padding, write nothing).
        interpret: run in Pallas' interpreter (off a GPU).
    """
    num_tokens, num_kv_heads, width, head_dim = qkv.shape
    group = width - 2
    num_layers, num_blocks, block_size = kv_cache.keys.shape[:3]
    slots_per_layer = num_blocks * block_size
    rows = (num_layers * slots_per_layer, num_kv_heads, head_dim)
    everything = pl.BlockSpec(rows, lambda t: (0, 0, 0))
    per_token = lambda *shape: pl.BlockSpec((None, *shape), lambda t: (t,) + (0,) * len(shape))
    whole = lambda size: pl.BlockSpec((size,), lambda t: (0,))
    kernel = functools.partial(_kernel, group=group, slots_per_layer=slots_per_layer, eps=eps)
    layer_index = jnp.asarray(layer, jnp.int32).reshape(1)
    flat_cache = (kv_cache.keys.reshape(rows), kv_cache.values.reshape(rows))
    q, keys, values = pl.pallas_call(
        kernel,
        grid=(num_tokens,),
        in_specs=[
            whole(1),
            pl.BlockSpec((1,), lambda t: (t,)),
            per_token(num_kv_heads, width, head_dim),
            whole(head_dim),
            whole(head_dim),
            per_token(head_dim),
            per_token(head_dim),
            everything,
            everything,
        ],
        out_specs=[per_token(num_kv_heads, group, head_dim), everything, everything],
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, num_kv_heads, group, head_dim), qkv.dtype),
            jax.ShapeDtypeStruct(rows, kv_cache.keys.dtype),
            jax.ShapeDtypeStruct(rows, kv_cache.values.dtype),
        ],
        input_output_aliases={7: 1, 8: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxllm_norm_rope_write",
    )(layer_index, slot_mapping, qkv, q_scale, k_scale, cos, sin, *flat_cache)
    shape = kv_cache.keys.shape
    q = q.reshape(num_tokens, num_kv_heads * group, head_dim)
    return q, KVCache(keys.reshape(shape), values.reshape(shape))
