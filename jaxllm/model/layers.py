"""Qwen3's building blocks as Flax linen modules: RMSNorm, rotary embedding, attention, MLP.

Every module is a pure function of its params and arguments; the paged KV cache goes in and
comes out explicitly. Each weight is declared with its logical axes (`sharded`).

Legend: T tokens, N query heads, K kv heads, H head dim, D model dim, F ffn dim, V vocab,
L layers (N, K, F, V: this device's share under tensor parallelism).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.model import qkv_kernel
from jaxllm.model.attention import PORTABLE, Kernels, attend
from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import KVCache, write_kv
from jaxllm.model.sharding import TP_AXIS

WEIGHT_INIT = nn.initializers.normal(stddev=0.02)


def sharded(axes: tuple[str, ...], init: nn.initializers.Initializer = WEIGHT_INIT):
    """`init` for a weight whose axes have these logical names (see `sharding.py`)."""
    return nn.with_logical_partitioning(init, axes)


class Qwen3Module(nn.Module):
    """Base of the layers: `config` holds global shapes, `kernels` the attention kernels; with
    `tp_size` > 1 the module runs inside shard_map on one device's share of each weight."""

    config: Qwen3Config
    tp_size: int = 1
    kernels: Kernels = PORTABLE


def add_shards(out: jax.Array, dtype: jnp.dtype, tp_size: int) -> jax.Array:
    """A row-parallel projection's float32 output [T, D], summed over the devices' shares."""
    # NOTE: the shares travel in the model dtype (half the bytes); one device keeps float32.
    return jax.lax.psum(out.astype(dtype), TP_AXIS) if tp_size > 1 else out


def embed_tokens(embed: jax.Array, token_ids: jax.Array, tp_size: int) -> jax.Array:
    """Looks up `token_ids` [T] in the (vocab-parallel) embedding [V, D] -> [T, D]; under tensor
    parallelism each device adds zeros for the tokens outside its vocab rows, which is exact."""
    if tp_size == 1:
        return embed[token_ids]
    vocab_per_device = embed.shape[0]
    local_ids = token_ids - jax.lax.axis_index(TP_AXIS) * vocab_per_device  # [T]
    mine = (local_ids >= 0) & (local_ids < vocab_per_device)
    x = embed[jnp.where(mine, local_ids, 0)]  # [T, D]
    return jax.lax.psum(jnp.where(mine[:, None], x, 0).astype(x.dtype), TP_AXIS)


class RMSNorm(nn.Module):
    """`x / rms(x) * scale` over the last axis, computed in float32 (as HF Qwen3RMSNorm)."""

    eps: float
    dtype: jnp.dtype
    axis: str = "embed"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = sharded((self.axis,), nn.initializers.ones)
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(self.dtype)


class NormScale(nn.Module):
    """An RMSNorm's scale alone (the same param), for a kernel that applies the norm itself."""

    dtype: jnp.dtype
    axis: str = "embed"

    @nn.compact
    def __call__(self, size: int) -> jax.Array:
        return self.param("scale", sharded((self.axis,), nn.initializers.ones), (size,), self.dtype)


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


class Attention(Qwen3Module):
    """Grouped-query self-attention with per-head q/k RMSNorm over the paged cache.

    q/k/v are one column-parallel weight `qkv_proj` [D, K, G + 2, H] (G = N / K), so a device's
    kv heads carry their query heads and one matmul computes all three. o_proj is row-parallel.
    """

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
        """x [T, D] -> ([T, D], kv_cache with this step's K/V written at layer `layer`); rows of
        x after the step's own (`Kernels.decode_rows`) are zero, and stay so."""
        c = self.config
        rows = inputs.token_ids.shape[0]
        dtype = c.jnp_dtype
        d, h = c.hidden_size, c.head_dim
        n, k = c.num_heads // self.tp_size, c.num_kv_heads // self.tp_size
        g = n // k
        axes = ("embed", "kv_heads", "qkv", "head_dim")
        qkv_proj = self.param("qkv_proj", sharded(axes), (d, k, g + 2, h), dtype)
        o_proj = self.param("o_proj", sharded(("heads", "head_dim", "embed")), (n, h, d), dtype)
        qkv = jnp.einsum("TD,DKGH->TKGH", x, qkv_proj)[:rows]
        # The "pallas" decode steps fuse q/k norms, rotary embedding and the cache write.
        fused = self.kernels.decode == "pallas" and inputs.tile_size == 1
        if fused and qkv_kernel.kernel_fits(k, g, h):
            q_scale = NormScale(dtype, "head_dim", name="q_norm")(h)
            k_scale = NormScale(dtype, "head_dim", name="k_norm")(h)
            q, kv_cache = qkv_kernel.norm_rope_write(
                qkv, q_scale, k_scale, cos, sin, kv_cache, layer, inputs.slot_mapping,
                eps=c.rms_norm_eps, interpret=self.kernels.interpret,
            )  # fmt: skip
        else:
            q = qkv[:, :, :g].reshape(rows, n, h)  # [T, N, H]
            keys, values = qkv[:, :, g], qkv[:, :, g + 1]  # [T, K, H] each
            q = RMSNorm(c.rms_norm_eps, dtype, "head_dim", name="q_norm")(q)
            keys = RMSNorm(c.rms_norm_eps, dtype, "head_dim", name="k_norm")(keys)
            q, keys = apply_rotary(q, cos, sin), apply_rotary(keys, cos, sin)
            # NOTE: write first, so a chunk's tokens see each other through the cache.
            kv_cache = write_kv(kv_cache, layer, keys, values, inputs.slot_mapping)
        # NOTE: the kernels see every layer's blocks as one pool (see kv_cache.py): no copy.
        key_pool, value_pool = kv_cache.layer_views()  # [L * NB, BS, K, H] each
        block_tables = inputs.block_tables + layer * kv_cache.num_blocks
        out = attend(q, key_pool, value_pool, inputs._replace(block_tables=block_tables),
                     self.kernels)  # fmt: skip
        out = jnp.pad(out, ((0, x.shape[0] - rows), (0, 0), (0, 0)))
        out = jnp.einsum("TNH,NHD->TD", out, o_proj, preferred_element_type=jnp.float32)
        return add_shards(out, dtype, self.tp_size), kv_cache


class MLP(Qwen3Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`; gate and up one column-parallel weight
    `gate_up_proj` [D, 2, F] (one matmul), down row-parallel."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = c.jnp_dtype
        d, f = c.hidden_size, c.intermediate_size // self.tp_size
        axes = ("embed", "gate_up", "ffn")
        gate_up_proj = self.param("gate_up_proj", sharded(axes), (d, 2, f), dtype)
        down_proj = self.param("down_proj", sharded(("ffn", "embed")), (f, d), dtype)
        gate_up = jnp.einsum("TD,DGF->TGF", x, gate_up_proj)
        hidden = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]  # [T, F]
        out = jnp.einsum("TF,FD->TD", hidden, down_proj, preferred_element_type=jnp.float32)
        return add_shards(out, dtype, self.tp_size)


class DecoderLayer(Qwen3Module):
    """One pre-norm transformer block; writes its K/V into the whole cache at `layer`, so XLA
    updates the donated buffer in place.

    NOTE: x, the residual stream, is float32 whatever the model dtype, and o_proj and down_proj
    add their float32 accumulators to it: a bfloat16 stream would round every add (figures in
    docs/performance.md).
    """

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        kv_cache: KVCache,
        layer: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        inputs: ModelInputs,
    ) -> tuple[jax.Array, KVCache]:
        c = self.config
        attn_in = RMSNorm(c.rms_norm_eps, c.jnp_dtype, name="attn_norm")(x)
        attention = Attention(c, self.tp_size, self.kernels, name="attn")
        attn_out, kv_cache = attention(attn_in, cos, sin, kv_cache, layer, inputs)
        x = x + attn_out
        mlp_in = RMSNorm(c.rms_norm_eps, c.jnp_dtype, name="mlp_norm")(x)
        x = x + MLP(c, self.tp_size, name="mlp")(mlp_in)
        return x, kv_cache
