"""Qwen3's building blocks as Flax linen modules: RMSNorm, rotary embedding, attention, MLP.

Every module is a pure function of its params and arguments; the paged KV cache goes in and
comes out explicitly. Each weight is declared with its logical axes (`sharded`), which
`jaxllm.model.sharding` maps to the mesh.

Tensor parallelism: a module with `tp_size > 1` runs inside `shard_map` and declares and
computes with its device's share of the sharded axes (N / tp heads, K / tp kv heads, F / tp ffn
columns); the row-parallel projections (o_proj, down_proj) then add the devices' partial sums.
With `tp_size == 1` the same code is the plain model.

Legend: T tokens, N query heads, K kv heads, H head dim, D model dim, F ffn dim, V vocab,
L layers (N, K, F, V: this device's share under tensor parallelism).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.model import qkv_kernel
from jaxllm.model.attention import get_attention_backend
from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import KVCache, write_kv
from jaxllm.model.sharding import TP_AXIS, sum_over_shards

WEIGHT_INIT = nn.initializers.normal(stddev=0.02)


def sharded(axes: tuple[str, ...], init: nn.initializers.Initializer = WEIGHT_INIT):
    """`init` for a weight whose axes have these logical names (see `sharding.py`)."""
    return nn.with_logical_partitioning(init, axes)


def add_shards(out: jax.Array, dtype: jnp.dtype, tp_size: int) -> jax.Array:
    """A row-parallel projection's float32 output [T, D], summed over the devices' shares.

    It updates the float32 residual stream (see DecoderLayer). Between devices the shares
    travel in the model `dtype`, half of float32's bytes; one device keeps all of float32.
    """
    return sum_over_shards(out.astype(dtype), tp_size) if tp_size > 1 else out


def embed_tokens(embed: jax.Array, token_ids: jax.Array, tp_size: int) -> jax.Array:
    """Looks up `token_ids` [T] in the (vocab-parallel) embedding [V, D] -> [T, D].

    Under tensor parallelism `embed` holds this device's rows of the vocabulary: tokens outside
    them contribute zeros and the devices' rows are added, which is exact.
    """
    if tp_size == 1:
        return embed[token_ids]
    vocab_per_device = embed.shape[0]
    local_ids = token_ids - jax.lax.axis_index(TP_AXIS) * vocab_per_device  # [T]
    mine = (local_ids >= 0) & (local_ids < vocab_per_device)
    x = embed[jnp.where(mine, local_ids, 0)]  # [T, D]
    return sum_over_shards(jnp.where(mine[:, None], x, 0).astype(x.dtype), tp_size)


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


class Attention(nn.Module):
    """Grouped-query self-attention with per-head q/k RMSNorm over the paged cache.

    q/k/v are column-parallel (split by heads), o_proj row-parallel. With `fused`, q/k/v are
    one weight `qkv_proj` [D, K, G + 2, H]: for each kv head its G = N / K query heads, its key
    and its value (so a device's kv heads carry their query heads), one matmul instead of three.
    """

    config: Qwen3Config
    tp_size: int = 1
    fused: bool = False

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
        """x [T, D] -> ([T, D], kv_cache with this step's K/V written at layer `layer`).

        Under tensor parallelism kv_cache holds this device's K kv heads.
        """
        c = self.config
        dtype = c.jnp_dtype
        d, h = c.hidden_size, c.head_dim
        n, k = c.num_heads // self.tp_size, c.num_kv_heads // self.tp_size
        if self.fused:
            g = n // k
            axes = ("embed", "kv_heads", "qkv", "head_dim")
            qkv_proj = self.param("qkv_proj", sharded(axes), (d, k, g + 2, h), dtype)
            qkv = jnp.einsum("TD,DKGH->TKGH", x, qkv_proj)
            q = qkv[:, :, :g].reshape(x.shape[0], n, h)
            keys, values = qkv[:, :, g], qkv[:, :, g + 1]
        else:
            axes = ("embed", "heads", "head_dim")
            q_proj = self.param("q_proj", sharded(axes), (d, n, h), dtype)
            axes = ("embed", "kv_heads", "head_dim")
            k_proj = self.param("k_proj", sharded(axes), (d, k, h), dtype)
            v_proj = self.param("v_proj", sharded(axes), (d, k, h), dtype)
            q = jnp.einsum("TD,DNH->TNH", x, q_proj)
            keys = jnp.einsum("TD,DKH->TKH", x, k_proj)
            values = jnp.einsum("TD,DKH->TKH", x, v_proj)
        o_proj = self.param("o_proj", sharded(("heads", "head_dim", "embed")), (n, h, d), dtype)
        if self.fused and self._uses_qkv_kernel(inputs, n, k, h):
            q_scale = NormScale(dtype, "head_dim", name="q_norm")(h)
            k_scale = NormScale(dtype, "head_dim", name="k_norm")(h)
            q, kv_cache = qkv_kernel.norm_rope_write(
                qkv,
                q_scale,
                k_scale,
                cos,
                sin,
                kv_cache,
                layer,
                inputs.slot_mapping,
                eps=c.rms_norm_eps,
                interpret=jax.default_backend() != "gpu",
            )
        else:
            q = RMSNorm(c.rms_norm_eps, dtype, "head_dim", name="q_norm")(q)
            keys = RMSNorm(c.rms_norm_eps, dtype, "head_dim", name="k_norm")(keys)
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
        # this device's heads' share
        out = jnp.einsum("TNH,NHD->TD", out, o_proj, preferred_element_type=jnp.float32)
        return add_shards(out, dtype, self.tp_size), kv_cache

    def _uses_qkv_kernel(
        self, inputs: ModelInputs, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> bool:
        """Whether q/k norms, rotary embedding and the cache write run as one kernel
        (qkv_kernel.py): in the "pallas" backend's decode steps (one-token tiles), where XLA
        runs them as six small kernels per layer."""
        return (
            self.config.attention_backend == "pallas"
            and inputs.tile_size == 1
            and qkv_kernel.kernel_fits(num_kv_heads, num_heads // num_kv_heads, head_dim)
        )


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`; gate/up column-parallel, down row-parallel."""

    config: Qwen3Config
    tp_size: int = 1
    fused: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = c.jnp_dtype
        d, f = c.hidden_size, c.intermediate_size // self.tp_size
        if self.fused:  # one weight [D, 2, F], one matmul
            axes = ("embed", "gate_up", "ffn")
            gate_up_proj = self.param("gate_up_proj", sharded(axes), (d, 2, f), dtype)
            gate_up = jnp.einsum("TD,DGF->TGF", x, gate_up_proj)
            gate, up = gate_up[:, 0], gate_up[:, 1]
        else:
            gate_proj = self.param("gate_proj", sharded(("embed", "ffn")), (d, f), dtype)
            up_proj = self.param("up_proj", sharded(("embed", "ffn")), (d, f), dtype)
            gate = jnp.einsum("TD,DF->TF", x, gate_proj)
            up = jnp.einsum("TD,DF->TF", x, up_proj)
        down_proj = self.param("down_proj", sharded(("ffn", "embed")), (f, d), dtype)
        hidden = jax.nn.silu(gate) * up
        # this device's share
        out = jnp.einsum("TF,FD->TD", hidden, down_proj, preferred_element_type=jnp.float32)
        return add_shards(out, dtype, self.tp_size)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: the body of the layer scan, or of the layer loop.

    The carry is `(x [T, D], kv_cache)`: the whole cache goes through every layer and each
    writes its slice at `layer`, so XLA updates the donated buffer in place. `fused`: q/k/v
    and gate/up each as one weight (see Attention, MLP).

    x, the residual stream, is float32 whatever the model's dtype, and o_proj and down_proj
    add to it what their GEMMs accumulated in float32; the model dtype is for weights, GEMM
    inputs and the KV cache. In bfloat16 the residual adds were each a rounding: over the 28
    layers of qwen3-0.6b (random weights) they put the logits 1.25e-2 (relative) from float32's
    instead of 0.69e-2, and two attention kernels' logits 1.41e-2 apart instead of 0.61e-2
    (`scripts/bf16_noise.py`). It costs a few MB of traffic per layer, where the GEMMs read the
    layer's weights.
    """

    config: Qwen3Config
    tp_size: int = 1
    fused: bool = False

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
        attention = Attention(c, self.tp_size, self.fused, name="attn")
        attn_out, kv_cache = attention(attn_in, cos, sin, kv_cache, layer, inputs)
        x = x + attn_out
        mlp_in = RMSNorm(c.rms_norm_eps, c.jnp_dtype, name="mlp_norm")(x)
        x = x + MLP(c, self.tp_size, self.fused, name="mlp")(mlp_in)
        return (x, kv_cache), None
