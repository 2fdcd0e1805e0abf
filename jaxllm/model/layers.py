"""Qwen3's building blocks as Flax linen modules: RMSNorm, rotary embedding, attention, MLP.

Every module is a pure function of its params and arguments; the paged KV cache goes in and
comes out explicitly.

Legend: T tokens, N query heads, K kv heads, H head dim, D model dim, F ffn dim, L layers.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.model.attention import get_attention_backend
from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import KVCache, write_kv

WEIGHT_INIT = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
    """`x / rms(x) * scale` over the last axis, computed in float32 (as HF Qwen3RMSNorm)."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(self.dtype)


def rotary_cos_sin(
    positions: jax.Array, head_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """Rotary tables for `positions` [T]: cos, sin [T, H] in float32 (halves repeated, as HF)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, H]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x` [T, heads, H] with HF's rotate-half convention; float32 inside."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with per-head q/k RMSNorm over the paged cache."""

    config: Qwen3Config

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        kv_cache: KVCache,
        layer: jax.Array,
        inputs: ModelInputs,
    ) -> tuple[jax.Array, KVCache]:
        """x [T, D] -> ([T, D], kv_cache with this step's K/V written at layer `layer`)."""
        c = self.config
        dtype = c.jnp_dtype
        d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        q_proj = self.param("q_proj", WEIGHT_INIT, (d, n, h), dtype)
        k_proj = self.param("k_proj", WEIGHT_INIT, (d, k, h), dtype)
        v_proj = self.param("v_proj", WEIGHT_INIT, (d, k, h), dtype)
        o_proj = self.param("o_proj", WEIGHT_INIT, (n, h, d), dtype)

        q = jnp.einsum("TD,DNH->TNH", x, q_proj)
        keys = jnp.einsum("TD,DKH->TKH", x, k_proj)
        values = jnp.einsum("TD,DKH->TKH", x, v_proj)
        q = RMSNorm(c.rms_norm_eps, dtype, name="q_norm")(q)
        keys = RMSNorm(c.rms_norm_eps, dtype, name="k_norm")(keys)
        q, keys = apply_rotary(q, cos, sin), apply_rotary(keys, cos, sin)

        # NOTE: write first, so a chunk's tokens see each other through the cache.
        kv_cache = write_kv(kv_cache, layer, keys, values, inputs.slot_mapping)
        # NOTE: the backends see every layer's blocks as one pool; this layer's blocks are
        # offset by layer * NB (see kv_cache.py), so nothing of the cache is sliced or copied.
        key_pool, value_pool = kv_cache.layer_views()  # [L * NB, BS, K, H] each
        layer_inputs = inputs.replace(
            block_tables=inputs.block_tables + layer * kv_cache.num_blocks
        )
        attend = get_attention_backend(c.attention_backend)
        out = attend(q, key_pool, value_pool, layer_inputs)  # [T, N, H]
        return jnp.einsum("TNH,NHD->TD", out, o_proj), kv_cache


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    config: Qwen3Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = c.jnp_dtype
        d, f = c.hidden_size, c.intermediate_size
        gate_proj = self.param("gate_proj", WEIGHT_INIT, (d, f), dtype)
        up_proj = self.param("up_proj", WEIGHT_INIT, (d, f), dtype)
        down_proj = self.param("down_proj", WEIGHT_INIT, (f, d), dtype)
        gate = jnp.einsum("TD,DF->TF", x, gate_proj)
        up = jnp.einsum("TD,DF->TF", x, up_proj)
        return jnp.einsum("TF,FD->TD", jax.nn.silu(gate) * up, down_proj)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block; the body of the layer scan.

    The carry is `(x [T, D], kv_cache)`: the whole cache goes through the
    scan and each layer writes its slice at `layer`, so XLA updates the donated buffer in place.
    """

    config: Qwen3Config

    @nn.compact
    def __call__(
        self,
        carry: tuple[jax.Array, KVCache],
        layer: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        inputs: ModelInputs,
    ) -> tuple[tuple[jax.Array, KVCache], None]:
        c = self.config
        x, kv_cache = carry
        attn_in = RMSNorm(c.rms_norm_eps, c.jnp_dtype, name="attn_norm")(x)
        attn_out, kv_cache = Attention(c, name="attn")(attn_in, cos, sin, kv_cache, layer, inputs)
        x = x + attn_out
        mlp_in = RMSNorm(c.rms_norm_eps, c.jnp_dtype, name="mlp_norm")(x)
        x = x + MLP(c, name="mlp")(mlp_in)
        return (x, kv_cache), None
