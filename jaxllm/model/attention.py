"""Attention backends over the paged KV cache, and the registry that names them.

A backend is `fn(q, k_cache, v_cache, inputs) -> out` with
    q: [T, N, H] the step's queries (rotary embedding applied),
    k_cache, v_cache: [NB, BS, K, H] one layer's cache, the step's own keys and values already
        written at `inputs.slot_mapping`,
    inputs: the step's `ModelInputs` (tiles, block tables, context lengths),
    out: [T, N, H] in q's dtype.
Rows of a tile attend with a bottom-right causal mask: row i of tile g sits at position
`context_lens[g] - tile_size + i` and sees the keys at positions up to its own.

Legend: T tokens, G tiles, R rows per tile (tile_size), W block-table width, NB blocks,
BS block size, P context positions (W * BS), N query heads, K kv heads, Q query heads per kv
head (N // K), H head dim.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxllm.model.inputs import ModelInputs

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, ModelInputs], jax.Array]

_BACKENDS: dict[str, AttentionFn] = {}
# jaxllm's other backends live in modules of their own, imported when first looked up.
_BUILTIN_MODULES = {
    "flash": "jaxllm.model.flash_attention",
    "pallas": "jaxllm.model.decode_attention",
}


def register_attention_backend(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator that makes `fn` available as `Qwen3Config(attention_backend=name)`."""

    def register(fn: AttentionFn) -> AttentionFn:
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is already registered")
        _BACKENDS[name] = fn
        return fn

    return register


def get_attention_backend(name: str) -> AttentionFn:
    """The backend registered under `name`; a ValueError lists the known names otherwise."""
    if name not in _BACKENDS and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        return _BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(_BACKENDS))
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None


def attention_backends() -> tuple[str, ...]:
    """Names of the registered backends (jaxllm's own included)."""
    for module in _BUILTIN_MODULES.values():
        importlib.import_module(module)
    return tuple(sorted(_BACKENDS))


@register_attention_backend("reference")
def reference_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: ModelInputs
) -> jax.Array:
    """Portable jax.numpy attention: gathers each tile's context through its block table.

    Memory is O(G * P * K * H) for the gathered context, so this suits tests, CPUs and modest
    batches; faster kernels register under other names.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_tiles, width = inputs.block_tables.shape
    tile_size = num_tokens // num_tiles
    group = num_heads // num_kv_heads
    context = width * block_size

    q = q.reshape(num_tiles, tile_size, num_kv_heads, group, head_dim)  # [G, R, K, Q, H]
    k = k_cache[inputs.block_tables].reshape(num_tiles, context, num_kv_heads, head_dim)
    v = v_cache[inputs.block_tables].reshape(num_tiles, context, num_kv_heads, head_dim)

    scores = jnp.einsum("GRKQH,GPKH->GKQRP", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)
    query_positions = inputs.context_lens[:, None] - tile_size + jnp.arange(tile_size)  # [G, R]
    key_positions = jnp.arange(context)  # [P]
    visible = key_positions[None, None, :] <= query_positions[:, :, None]  # [G, R, P]
    visible = visible[:, None, None]  # [G, 1, 1, R, P]
    # NOTE: a finite fill keeps rows with no visible key (front padding) free of NaN; they are
    # zeroed below.
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("GKQRP,GPKH->GRKQH", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
