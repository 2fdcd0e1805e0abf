"""The model's layer loop: one traced layer whatever the depth, and params sharded as declared."""

from __future__ import annotations

import re

import jax
from jax.sharding import NamedSharding
from support.inputs import Chunk, build_inputs, small_config

from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.qwen3 import forward, init_params, param_specs
from jaxllm.model.sharding import make_mesh

CONFIG = small_config(num_heads=4, num_kv_heads=2)
INPUTS = build_inputs(
    [Chunk([1, 2, 3, 4, 5], 0, [3]), Chunk([9, 8, 7], 0, [1])], 8, tile_size=4, table_width=1
)


def test_the_loop_traces_and_lowers_one_layer_called_once_per_layer():
    """Start-up time: a step's trace and lowering do not grow with the number of layers."""
    params = init_params(CONFIG, seed=0)
    cache = allocate_kv_cache(CONFIG, num_blocks=4, block_size=8)

    text = jax.jit(forward, static_argnums=1).lower(params, CONFIG, cache, INPUTS).as_text()

    assert len(re.findall(r"func\.func private @_apply_layer\b", text)) == 1
    assert len(re.findall(r"call @_apply_layer\(", text)) == CONFIG.num_layers


def test_random_params_are_sharded_as_their_specs():
    mesh = make_mesh(2)
    params = init_params(CONFIG, seed=6, mesh=mesh)

    specs = param_specs(CONFIG)
    assert jax.tree.structure(params) == jax.tree.structure(specs)
    for array, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs), strict=True):
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)
