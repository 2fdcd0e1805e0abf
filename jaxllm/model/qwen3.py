"""The Qwen3 causal LM as a Flax linen module, its pure forward function and random init.

`forward(params, config, kv_cache, inputs) -> (logits, kv_cache)` is the whole device step:
embed, the decoder layers carrying the paged KV cache (a `nn.scan` over stacked weights, or a
loop over one buffer per layer: below), the final norm, and the LM head at the sampled rows
only. Jit it with `static_argnums=1, donate_argnums=2` so the cache is updated in place, and
with `compiler_options=COMPILER_OPTIONS` as the engine does.

Layer loop. Inside the scan each layer's weights are a dynamic slice of the stacked arrays, and
XLA:GPU materialises every slice that feeds a matmul (a copy) before using it: on an H200 that
is 7 ms of a 28 ms qwen3-8b decode step (all layer weights read and written once more; the
optimised HLO shows the slices as fusions of their own). The model can instead run with one
buffer per layer (`layouts.unstack_layers`: params "layers_0" ... "layers_{L-1}", each without the L
axis) and a Python loop over them (`scan_layers=False`; the engine's default on a GPU), where
nothing is sliced. The loop calls one jitted layer function (`_layer_function`) with each
layer's params and a traced layer index, so JAX traces and lowers one layer per step shape and
XLA inlines the calls; XLA's compile time still grows with depth (about 2x the scan's on the
GPU, 4x on the CPU, which keeps the scan). The stacked tree stays the format of checkpoints and
of `load_params`.

Tensor parallelism. `sharded_forward(config, mesh)` runs the same `forward` under `shard_map`
over the mesh's "tp" axis. Inside, every array is one device's block: the module is built with
`tp_size` (a static int beside the global, unchanged config) and derives its local shapes from
both, N / tp query heads, K / tp kv heads, F / tp ffn columns and V / tp vocab rows, so the
param shapes it declares are exactly the blocks shard_map hands it. Only four lines
communicate: the vocab-parallel embedding and the two row-parallel projections of each layer
(o_proj, down_proj) add the devices' partial results (`psum`), and the vocab-parallel LM head's
logits are gathered, so every device returns the full [S, V] logits and the sampler runs on
them replicated. At tp_size 1 no collective is emitted and `forward` is the plain model.
Which axis is sharded is declared once: each weight's logical axes (below, in parentheses) and
`sharding.LOGICAL_AXIS_RULES`.

Param tree (layer params stacked on a leading L axis), global shapes and logical axes:
    embed [V, D] (vocab, embed)
    layers/attn_norm/scale [L, D] (layers, embed)
    layers/attn/{q_proj [L, D, N, H], k_proj [L, D, K, H], v_proj [L, D, K, H]}
        (layers, embed, heads | kv_heads, head_dim)
    layers/attn/o_proj [L, N, H, D] (layers, heads, head_dim, embed)
    layers/attn/{q_norm, k_norm}/scale [L, H] (layers, head_dim)
    layers/mlp_norm/scale [L, D] (layers, embed)
    layers/mlp/{gate_proj [L, D, F], up_proj [L, D, F]} (layers, embed, ffn)
    layers/mlp/down_proj [L, F, D] (layers, ffn, embed)
    final_norm/scale [D] (embed)
    lm_head [D, V] (embed, vocab) (untied models only; tied ones use embed)
With fused projections (`layouts.fuse_projections`, either layout; G = N / K):
    layers/attn/qkv_proj [L, D, K, G + 2, H] (layers, embed, kv_heads, qkv, head_dim)
    layers/mlp/gate_up_proj [L, D, 2, F] (layers, embed, gate_up, ffn)

Legend: T tokens, G tiles, S sampled rows, N query heads, K kv heads, H head dim, D model dim,
F ffn dim, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import KVCache, allocate_kv_cache, kv_cache_specs
from jaxllm.model.layers import DecoderLayer, RMSNorm, embed_tokens, rotary_cos_sin, sharded
from jaxllm.model.layouts import Params, is_fused, is_stacked
from jaxllm.model.sharding import (
    check_tensor_parallel,
    gather_shards,
    logical_to_spec,
    shard_map,
    tensor_parallel_size,
)

EMBEDDING_PARAMS = ("embed", "lm_head")


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 decoder-only LM over a paged KV cache.

    Attributes:
        config: the model (global shapes).
        tp_size: devices of the "tp" mesh axis; above 1 the module runs inside shard_map on one
            device's blocks (see the module docstring).
        scan_layers: a scan over stacked layer params ("layers"), or a loop over one param
            tree per layer ("layers_{i}"); see the module docstring.
        fused: q/k/v and gate/up each as one weight (`layouts.fuse_projections`).
    """

    config: Qwen3Config
    tp_size: int = 1
    scan_layers: bool = True
    fused: bool = False

    @nn.compact
    def __call__(self, kv_cache: KVCache, inputs: ModelInputs) -> tuple[jax.Array, KVCache]:
        c, tp = self.config, self.tp_size
        dtype = c.jnp_dtype
        vocab = c.vocab_size // tp
        embed = self.param("embed", sharded(("vocab", "embed")), (vocab, c.hidden_size), dtype)
        x = embed_tokens(embed, inputs.token_ids, tp).astype(jnp.float32)  # [T, D] (DecoderLayer)
        cos, sin = rotary_cos_sin(inputs.positions, c.head_dim, c.rope_theta)  # [T, H] each

        if self.scan_layers:
            layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=c.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
            carry = (x, kv_cache)
            layers = layers(c, tp, self.fused, name="layers")
            (x, kv_cache), _ = layers(carry, layer_ids, cos, sin, inputs)
        elif self.is_initializing():
            for i in range(c.num_layers):
                layer = DecoderLayer(c, tp, self.fused, name=f"layers_{i}")
                (x, kv_cache), _ = layer((x, kv_cache), i, cos, sin, inputs)
        else:
            apply_layer = _layer_function(c, tp, self.fused)
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
        return gather_shards(logits, 1, tp), kv_cache  # [S, V] (all of V)


@functools.cache
def _layer_function(
    config: Qwen3Config, tp_size: int, fused: bool
) -> Callable[..., tuple[jax.Array, KVCache]]:
    """One decoder layer as a jitted pure function of its params and a traced layer index.

    The layer loop calls it once per layer: JAX traces and lowers it once per step shape and
    the step calls it L times (XLA inlines the calls), where tracing the layers one by one made
    each step's trace, lowering and cache lookup L times longer (start-up time).
    """

    def apply_layer(params, x, kv_cache, layer, cos, sin, inputs):
        module = DecoderLayer(config, tp_size, fused)
        (x, kv_cache), _ = module.apply({"params": params}, (x, kv_cache), layer, cos, sin, inputs)
        return x, kv_cache

    return jax.jit(apply_layer)


# NOTE: XLA's rematerialization pass is off for every model step. It can only recompute the
# step's activations (a few hundred MB at most), never the donated cache, which fills the rest
# of the memory. With the layers unrolled (`scan_layers=False`) it counted that cache twice, as
# the entry parameter and as the in-place-updated result, so it believed a full-memory step
# needed 2x the cache and recomputed matmuls on every step (buffer assignment does update the
# cache in place). The engine sizes the cache after measuring the step's own scratch
# (`runner.step_scratch_bytes`).
# NOTE: and no split-K GEMMs. At a decode step's few rows XLA:GPU's autotuner split o_proj's and
# down_proj's contraction 8 ways, each split writing float32 partial sums that a kernel of its own
# then added up (4.4 us per projection on an H200, about as long as the GEMM); unsplit, cuBLAS
# takes them and a 0.6B decode step at batch 256 spends 0.1-0.2 ms less on the device outside
# attention (docs/performance.md). Other backends ignore the option.
COMPILER_OPTIONS = {
    "xla_disable_hlo_passes": "rematerialization",
    "xla_gpu_experimental_force_split_k": 1,
}


def forward(
    params: Params,
    config: Qwen3Config,
    kv_cache: KVCache,
    inputs: ModelInputs,
    tp_size: int = 1,
) -> tuple[jax.Array, KVCache]:
    """One model step over the paged cache.

    Args:
        params: the param tree (see the module docstring); one device's blocks if tp_size > 1.
        config: the model config (static under jit).
        kv_cache: the paged cache (see kv_cache.py); donate it under jit.
        inputs: the step's token ids, positions and cache addressing.
        tp_size: 1, or the "tp" axis size when called inside shard_map (`sharded_forward`).

    Returns:
        logits [S, V] float32 at `inputs.sample_indices`, and the updated cache.
    """
    model = Qwen3ForCausalLM(
        config, tp_size, scan_layers=is_stacked(params), fused=is_fused(params)
    )
    return model.apply({"params": params}, kv_cache, inputs)


def sharded_forward(
    config: Qwen3Config, mesh: Mesh, scan_layers: bool = True, fused: bool = False
) -> Callable[[Params, KVCache, ModelInputs], tuple[jax.Array, KVCache]]:
    """`forward` under shard_map over `mesh`: (params, kv_cache, inputs) -> (logits, kv_cache).

    Params and cache come sharded as `param_shardings` and `kv_cache.kv_cache_specs` say, the
    inputs replicated; the logits [S, V] come back replicated. Jit it with `donate_argnums=1`
    and `compiler_options=COMPILER_OPTIONS`, as the engine's runner does.
    `scan_layers=False` takes the params with one tree per layer (`layouts.unstack_layers`),
    `fused` those with fused projections (`layouts.fuse_projections`), sharded as `param_specs`
    says.

    Raises:
        ValueError: the mesh's size does not divide the heads, kv heads, ffn or vocab.
    """
    tp_size = tensor_parallel_size(mesh)
    check_tensor_parallel(config, tp_size)

    def step(params: Params, kv_cache: KVCache, inputs: ModelInputs):
        return forward(params, config, kv_cache, inputs, tp_size)

    return shard_map(
        step,
        mesh,
        in_specs=(param_specs(config, scan_layers, fused), kv_cache_specs(), PartitionSpec()),
        out_specs=(PartitionSpec(), kv_cache_specs()),
    )


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


def _boxed_init(
    config: Qwen3Config, key: jax.Array, scan_layers: bool = True, fused: bool = False
) -> Params:
    """Random params, each wrapped with its logical axes (`nn.LogicallyPartitioned`)."""
    kv_cache = allocate_kv_cache(config, num_blocks=1, block_size=8)
    model = Qwen3ForCausalLM(config, scan_layers=scan_layers, fused=fused)
    return model.init(key, kv_cache, dummy_inputs())["params"]


def _init(config: Qwen3Config, key: jax.Array) -> Params:
    return nn.meta.unbox(_boxed_init(config, key))


def param_specs(config: Qwen3Config, scan_layers: bool = True, fused: bool = False) -> Params:
    """The param tree of mesh `PartitionSpec`s, from each weight's logical axes (for the
    stacked tree, or with `scan_layers=False` for one tree per layer; `fused`: with fused
    projections)."""
    init = functools.partial(_boxed_init, config, scan_layers=scan_layers, fused=fused)
    boxed = jax.eval_shape(init, jax.random.key(0))
    return jax.tree.map(
        lambda spec: logical_to_spec(tuple(spec)),
        nn.get_partition_spec(boxed),
        is_leaf=lambda leaf: isinstance(leaf, PartitionSpec),
    )


def param_shardings(config: Qwen3Config, mesh: Mesh) -> Params:
    """The param tree of `NamedSharding`s over `mesh`."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(config),
        is_leaf=lambda leaf: isinstance(leaf, PartitionSpec),
    )


def init_params(config: Qwen3Config, seed: int = 0, mesh: Mesh | None = None) -> Params:
    """Random params (normal(0.02) weights, unit norms) made on the device(s) by one jit.

    With a `mesh`, each device computes only its own blocks (the jit's out_shardings); the
    values do not depend on the mesh (jax's partitionable threefry).
    """
    out_shardings = None
    if mesh is not None:
        check_tensor_parallel(config, tensor_parallel_size(mesh))
        out_shardings = param_shardings(config, mesh)
    init = jax.jit(functools.partial(_init, config), out_shardings=out_shardings)
    return init(jax.random.key(seed))


def abstract_params(config: Qwen3Config) -> Params:
    """The param tree as `jax.ShapeDtypeStruct`s (global shapes); allocates nothing."""
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
