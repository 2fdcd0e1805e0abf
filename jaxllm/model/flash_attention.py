"""FlashAttention-3 (Hopper) paged attention, from the optional `flash-attn3-jax` package.

`pip install "jaxllm[hopper]"` brings it; `jaxllm.platform` decides when it runs. It takes the
step's tiles as they are (`inputs.py`): queries `[G, R, N, H]`, `page_table=block_tables` and
`cache_seqlens=context_lens` with a bottom-right causal mask. It only reads the cache, where the
layer has already written the step's K/V.

Legend: T tokens, G tiles, R rows per tile, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model.inputs import ModelInputs

try:
    from flash_attn3_jax import flash_mha_with_kvcache
except ImportError:  # an optional extra
    flash_mha_with_kvcache = None

# NOTE: Hopper's 132 SMs: below about two blocks of work per SM, split the keys.
_NUM_SMS = 132


def installed() -> bool:
    """Whether the `flash-attn3-jax` package is installed."""
    return flash_mha_with_kvcache is not None


def flash_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: ModelInputs
) -> jax.Array:
    """Paged attention of every tile over its context with FlashAttention-3 (bf16/fp16 only)."""
    if flash_mha_with_kvcache is None:
        raise RuntimeError(
            'the "flash" attention kernel needs the flash-attn3-jax package: '
            'pip install "jaxllm[hopper]"'
        )
    num_tokens, num_heads, head_dim = q.shape
    num_tiles = inputs.block_tables.shape[0]
    tile_size = num_tokens // num_tiles
    num_kv_heads = k_cache.shape[2]
    work = num_tiles * num_kv_heads * max(1, tile_size // 64)
    num_splits = int(min(16, max(1, 2 * _NUM_SMS // work)))
    # NOTE: an all-padding tile has no context; give it one position so no row is empty.
    context_lens = jnp.maximum(inputs.context_lens, 1)
    out = flash_mha_with_kvcache(
        q.reshape(num_tiles, tile_size, num_heads, head_dim),
        k_cache,
        v_cache,
        cache_seqlens=context_lens,
        page_table=inputs.block_tables,
        is_causal=True,
        num_splits=num_splits,
    )
    return out.reshape(num_tokens, num_heads, head_dim)
