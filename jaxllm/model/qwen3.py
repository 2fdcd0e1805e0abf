"""The Qwen3 causal LM as a Flax linen module, its pure forward function and random init.

`forward(params, config, kv_cache, inputs) -> (logits, kv_cache)` is the whole device step:
embed, a `nn.scan` over the stacked decoder layers (compile time independent of depth) that
carries the paged KV cache, the final norm, and the LM head at the sampled rows only.
Jit it with `static_argnums=1, donate_argnums=2` so the cache is updated in place.

Param tree (layer params stacked on a leading L axis):
    embed [V, D]
    layers/attn_norm/scale [L, D]
    layers/attn/{q_proj [L, D, N, H], k_proj [L, D, K, H], v_proj [L, D, K, H], o_proj [L, N, H, D]}
    layers/attn/{q_norm, k_norm}/scale [L, H]
    layers/mlp_norm/scale [L, D]
    layers/mlp/{gate_proj [L, D, F], up_proj [L, D, F], down_proj [L, F, D]}
    final_norm/scale [D]
    lm_head [D, V] (untied models only; tied ones use embed)

Legend: T tokens, G tiles, S sampled rows, N query heads, K kv heads, H head dim, D model dim,
F ffn dim, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import KVCache, allocate_kv_cache
from jaxllm.model.layers import WEIGHT_INIT, DecoderLayer, RMSNorm, rotary_cos_sin

Params = dict[str, Any]

EMBEDDING_PARAMS = ("embed", "lm_head")


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder-only LM over a paged KV cache."""

    config: Qwen3Config

    @nn.compact
    def __call__(self, kv_cache: KVCache, inputs: ModelInputs) -> tuple[jax.Array, KVCache]:
        c = self.config
        dtype = c.jnp_dtype
        embed = self.param("embed", WEIGHT_INIT, (c.vocab_size, c.hidden_size), dtype)
        x = embed[inputs.token_ids]  # [T, D]
        cos, sin = rotary_cos_sin(inputs.positions, c.head_dim, c.rope_theta)  # [T, H] each

        layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=c.num_layers,
        )
        layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
        (x, kv_cache), _ = layers(c, name="layers")((x, kv_cache), layer_ids, cos, sin, inputs)

        x = RMSNorm(c.rms_norm_eps, dtype, name="final_norm")(x[inputs.sample_indices])  # [S, D]
        if c.tie_word_embeddings:
            logits = jnp.einsum("SD,VD->SV", x, embed, preferred_element_type=jnp.float32)
        else:
            lm_head = self.param("lm_head", WEIGHT_INIT, (c.hidden_size, c.vocab_size), dtype)
            logits = jnp.einsum("SD,DV->SV", x, lm_head, preferred_element_type=jnp.float32)
        return logits, kv_cache


def forward(
    params: Params, config: Qwen3Config, kv_cache: KVCache, inputs: ModelInputs
) -> tuple[jax.Array, KVCache]:
    """One model step over the paged cache.

    Args:
        params: the param tree (see the module docstring).
        config: the model config (static under jit).
        kv_cache: the paged cache (see kv_cache.py); donate it under jit.
        inputs: the step's token ids, positions and cache addressing.

    Returns:
        logits [S, V] float32 at `inputs.sample_indices`, and the updated cache.
    """
    return Qwen3ForCausalLM(config).apply({"params": params}, kv_cache, inputs)


def dummy_inputs() -> ModelInputs:
    """The smallest valid inputs: one token at position 0 in block 0."""
    one = jnp.zeros((1,), jnp.int32)
    return ModelInputs(
        token_ids=one,
        positions=one,
        slot_mapping=one,
        block_tables=jnp.zeros((1, 1), jnp.int32),
        context_lens=jnp.ones((1,), jnp.int32),
        sample_indices=one,
    )


@functools.partial(jax.jit, static_argnums=0)
def _init(config: Qwen3Config, key: jax.Array) -> Params:
    kv_cache = allocate_kv_cache(config, num_blocks=1, block_size=8)
    variables = Qwen3ForCausalLM(config).init(key, kv_cache, dummy_inputs())
    return variables["params"]


def init_params(config: Qwen3Config, seed: int = 0) -> Params:
    """Random params (normal(0.02) weights, unit norms) made on the default device by one jit."""
    return _init(config, jax.random.key(seed))


def abstract_params(config: Qwen3Config) -> Params:
    """The param tree as `jax.ShapeDtypeStruct`s; allocates nothing."""
    return jax.eval_shape(functools.partial(_init, config), jax.random.key(0))


def param_count(config: Qwen3Config, non_embedding: bool = False) -> int:
    """Number of parameters, without allocating; `non_embedding` leaves out embed and lm_head."""
    tree = abstract_params(config)
    if non_embedding:
        tree = {name: value for name, value in tree.items() if name not in EMBEDDING_PARAMS}
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def params_nbytes(params: Params) -> int:
    """Total bytes of a param tree (arrays or ShapeDtypeStructs)."""
    leaves = jax.tree.leaves(params)
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
