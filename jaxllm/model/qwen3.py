"""The Qwen3 causal LM as a Flax linen module, its pure forward function and random init.

`forward` is the whole device step: embed, the decoder layers carrying the paged KV cache, the
final norm, and the LM head at the sampled rows only. Jit it with the cache donated and with
`compiler_options=COMPILER_OPTIONS`, as the runner does.

Each layer has a param tree of its own ("layers_{i}"); the model loops over them in Python,
calling one jitted layer function with a traced layer index, so JAX lowers one layer per step
shape and XLA inlines the L calls. NOTE: not a scan over stacked weights, whose slices XLA:GPU
copies before every matmul (docs/performance.md).

Tensor parallelism (`sharded_forward`): each device holds its blocks of the weights (logical
axes below; `sharding.py`); the embedding, o_proj and down_proj add the devices' partial
results (`psum`) and the logits are gathered.

Param tree, global shapes and logical axes (G = N / K):
    embed [V, D] (vocab, embed)
    layers_{i}/attn_norm/scale [D] (embed)
    layers_{i}/attn/qkv_proj [D, K, G + 2, H] (embed, kv_heads, qkv, head_dim): for each kv
        head its G query heads, its key and its value
    layers_{i}/attn/o_proj [N, H, D] (heads, head_dim, embed)
    layers_{i}/attn/{q_norm, k_norm}/scale [H] (head_dim)
    layers_{i}/mlp_norm/scale [D] (embed)
    layers_{i}/mlp/gate_up_proj [D, 2, F] (embed, gate_up, ffn)
    layers_{i}/mlp/down_proj [F, D] (ffn, embed)
    final_norm/scale [D] (embed)
    lm_head [D, V] (embed, vocab) (untied models only; tied ones use embed)

Legend: T tokens, S sampled rows, N query heads, K kv heads, H head dim, D model dim,
F ffn dim, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.model.attention import PORTABLE, Kernels
from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import KVCache, allocate_kv_cache, kv_cache_specs
from jaxllm.model.layers import DecoderLayer, RMSNorm, embed_tokens, rotary_cos_sin, sharded
from jaxllm.model.sharding import (
    TP_AXIS,
    check_tensor_parallel,
    logical_to_spec,
    shard_map,
    tensor_parallel_size,
)

Params = dict[str, Any]

# NOTE: no rematerialization: with the layers unrolled it counts the donated cache twice and
# recomputes matmuls; the engine sizes the cache from the step's scratch (`step_scratch_bytes`;
# figures in docs/performance.md).
COMPILER_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}
# XLA's default optimization, even where XLA_FLAGS lower it for quicker compiles (the tests' do),
# for the programs that run longest for their compile: the draws of a random embedding, the
# sampler's one-pass variants (`runner`) and the token mask (`logits_processors`). Under the
# tests' flags on a 2-core CPU: qwen3-tiny's random params in 1.6 s rather than 4.8, 4 rows of
# 151,936 tokens sampled in 2.7 ms rather than 33, masked in 0.3 ms rather than 3.4
# (docs/performance.md).
DEFAULT_OPTIMIZATION = {
    "xla_backend_optimization_level": 3,
    "xla_llvm_disable_expensive_passes": False,
}


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder-only LM over a paged KV cache; `init` makes all params but the layers',
    which `init_params` makes."""

    config: Qwen3Config
    tp_size: int = 1
    kernels: Kernels = PORTABLE

    @nn.compact
    def __call__(self, kv_cache: KVCache, inputs: ModelInputs) -> tuple[jax.Array, KVCache]:
        c, tp = self.config, self.tp_size
        dtype = c.jnp_dtype
        vocab = c.vocab_size // tp
        embed = self.param("embed", sharded(("vocab", "embed")), (vocab, c.hidden_size), dtype)
        x = embed_tokens(embed, inputs.token_ids, tp).astype(jnp.float32)  # [T, D] (DecoderLayer)
        if inputs.tile_size == 1 and x.shape[0] < self.kernels.decode_rows:
            # Zero rows after the step's own, for the layers' matmuls (`Kernels.decode_rows`).
            x = jnp.pad(x, ((0, self.kernels.decode_rows - x.shape[0]), (0, 0)))
        cos, sin = rotary_cos_sin(inputs.positions, c.head_dim, c.rope_theta)  # [T, H] each

        apply_layer = jax.jit(functools.partial(_apply_layer, c, tp, self.kernels))
        for i in range(c.num_layers):
            layer_params = self.variables["params"][f"layers_{i}"]
            x, kv_cache = apply_layer(layer_params, x, kv_cache, np.int32(i), cos, sin, inputs)

        x = RMSNorm(c.rms_norm_eps, dtype, name="final_norm")(x[inputs.sample_indices])  # [S, D]
        if c.tie_word_embeddings:
            logits = jnp.einsum("SD,VD->SV", x, embed, preferred_element_type=jnp.float32)
        else:
            init = sharded(("embed", "vocab"))
            lm_head = self.param("lm_head", init, (c.hidden_size, vocab), dtype)
            logits = jnp.einsum("SD,DV->SV", x, lm_head, preferred_element_type=jnp.float32)
        if tp > 1:  # all of V
            logits = jax.lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)
        return logits, kv_cache  # [S, V]


def _apply_layer(config, tp_size, kernels, params, x, kv_cache, layer, cos, sin, inputs):
    """One decoder layer as a pure function of its params and a traced layer index."""
    module = DecoderLayer(config, tp_size, kernels)
    return module.apply({"params": params}, x, kv_cache, layer, cos, sin, inputs)


def forward(
    params: Params,
    config: Qwen3Config,
    kv_cache: KVCache,
    inputs: ModelInputs,
    kernels: Kernels = PORTABLE,
    tp_size: int = 1,
) -> tuple[jax.Array, KVCache]:
    """One model step over the paged cache: logits [S, V] float32 at `inputs.sample_indices`,
    and the updated cache.

    Args:
        params: the param tree (see the module docstring); one device's blocks if tp_size > 1.
        config, kernels: the model config and the attention kernels (static under jit).
        kv_cache: the paged cache (see kv_cache.py); donate it under jit.
        tp_size: 1, or the "tp" axis size when called inside shard_map (`sharded_forward`).
    """
    return Qwen3ForCausalLM(config, tp_size, kernels).apply({"params": params}, kv_cache, inputs)


def sharded_forward(
    config: Qwen3Config, mesh: Mesh, kernels: Kernels = PORTABLE
) -> Callable[[Params, KVCache, ModelInputs], tuple[jax.Array, KVCache]]:
    """`forward` under shard_map over `mesh`: (params, kv_cache, inputs) -> (logits, kv_cache).

    Params and cache come sharded as `param_specs` and `kv_cache.kv_cache_specs` say, the
    inputs replicated; the logits [S, V] come back replicated.

    Raises:
        ValueError: the mesh's size does not divide the heads, kv heads, ffn or vocab.
    """
    tp_size = tensor_parallel_size(mesh)
    check_tensor_parallel(config, tp_size)

    def step(params: Params, kv_cache: KVCache, inputs: ModelInputs):
        return forward(params, config, kv_cache, inputs, kernels, tp_size)

    in_specs = (param_specs(config), kv_cache_specs(), PartitionSpec())
    return shard_map(step, mesh, in_specs, out_specs=(PartitionSpec(), kv_cache_specs()))


def _dummy_inputs() -> ModelInputs:
    """The smallest valid inputs: one token at position 0 in block 0."""
    inputs = ModelInputs.padding(num_tokens=1, num_tiles=1, num_sampled=1, width=1)
    return jax.tree.map(jnp.asarray, inputs._replace(context_lens=np.ones(1, np.int32)))


def _boxed_outer(config: Qwen3Config, key: jax.Array) -> Params:
    """Random params of everything but the layers, wrapped with their logical axes."""
    outer = config.replace(num_layers=0)
    cache = allocate_kv_cache(outer, num_blocks=1, block_size=8)
    return Qwen3ForCausalLM(outer).init(key, cache, _dummy_inputs())["params"]


def _boxed_layer(config: Qwen3Config, key: jax.Array) -> Params:
    """Random params of one decoder layer, wrapped with their logical axes."""
    cache = allocate_kv_cache(config.replace(num_layers=1), num_blocks=1, block_size=8)
    x = jnp.zeros((1, config.hidden_size), jnp.float32)
    cos = sin = jnp.zeros((1, config.head_dim), jnp.float32)
    return DecoderLayer(config).init(key, x, cache, 0, cos, sin, _dummy_inputs())["params"]


# NOTE: remembered per config (a pure function of it, traced through the modules), as every
# engine start and checkpoint load asks for it; callers get trees mapped from it, never it.
@functools.lru_cache(maxsize=8)
def _boxed_shapes(config: Qwen3Config) -> Params:
    """The param tree as shapes wrapped with their logical axes; one layer's computed once."""
    key = jax.random.key(0)
    outer = jax.eval_shape(functools.partial(_boxed_outer, config), key)
    layer = jax.eval_shape(functools.partial(_boxed_layer, config), key)
    return outer | {f"layers_{i}": layer for i in range(config.num_layers)}


def param_specs(config: Qwen3Config) -> Params:
    """The param tree of mesh `PartitionSpec`s, from each weight's logical axes."""
    logical = nn.get_partition_spec(_boxed_shapes(config))
    return jax.tree.map(lambda spec: logical_to_spec(tuple(spec)), logical)


def param_shardings(config: Qwen3Config, mesh: Mesh) -> Params:
    """The param tree of `NamedSharding`s over `mesh`; a ValueError if the mesh's size does not
    divide the heads, kv heads, ffn or vocab."""
    check_tensor_parallel(config, tensor_parallel_size(mesh))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(config))


def abstract_params(config: Qwen3Config) -> Params:
    """The param tree as `jax.ShapeDtypeStruct`s (global shapes); allocates nothing."""
    return nn.meta.unbox(_boxed_shapes(config))


def sharded_param_shapes(config: Qwen3Config, mesh: Mesh) -> Params:
    """The param tree as `jax.ShapeDtypeStruct`s sharded over `mesh`; allocates nothing."""
    shardings = param_shardings(config, mesh)
    return jax.tree.map(lambda leaf, s: leaf.update(sharding=s), abstract_params(config), shardings)


def init_params(config: Qwen3Config, seed: int = 0, mesh: Mesh | None = None) -> Params:
    """Random params (normal(0.02) weights, unit norms) made on the device(s).

    One jitted function makes every layer from a key of its own, so one layer is compiled. With
    a mesh each device computes only its own blocks, and the values do not depend on the mesh
    (jax's partitionable threefry); without one the params are on the default device.
    """
    keys = jax.random.split(jax.random.key(seed), config.num_layers + 1)
    shardings = {} if mesh is None else param_shardings(config, mesh)

    def made_by(boxed_init, out_shardings, options=None):
        unboxed = lambda key: nn.meta.unbox(boxed_init(config, key))
        return jax.jit(unboxed, out_shardings=out_shardings, compiler_options=options)

    outer = {name: value for name, value in shardings.items() if not name.startswith("layers_")}
    params = made_by(_boxed_outer, outer or None, DEFAULT_OPTIMIZATION)(keys[0])
    make_layer = made_by(_boxed_layer, shardings.get("layers_0"))
    for i in range(config.num_layers):
        params[f"layers_{i}"] = make_layer(keys[i + 1])
    return params


def param_count(config: Qwen3Config, non_embedding: bool = False) -> int:
    """Number of parameters, without allocating; `non_embedding` leaves out embed and lm_head."""
    tree = abstract_params(config)
    if non_embedding:
        tree = {name: value for name, value in tree.items() if name not in ("embed", "lm_head")}
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))
