"""Param layouts (`layouts.py`): the layer loop over one tree per layer, which traces one layer,
and fused projections (q/k/v and gate/up each as one weight per layer)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.layouts import fuse_projections, is_fused, unfuse_projections, unstack_layers
from jaxllm.model.qwen3 import forward, init_params, param_specs
from jaxllm.model.sharding import make_mesh

from .helpers import Chunk, build_inputs, small_config

CONFIG = small_config(num_heads=4, num_kv_heads=2)
GROUP = CONFIG.num_heads // CONFIG.num_kv_heads
INPUTS = build_inputs(
    [Chunk([1, 2, 3, 4, 5], 0, [3]), Chunk([9, 8, 7], 0, [1])], 8, tile_size=4, table_width=1
)


def run(params):
    step = jax.jit(forward, static_argnums=1)
    return step(params, CONFIG, allocate_kv_cache(CONFIG, num_blocks=4, block_size=8), INPUTS)


def layouts(seed: int, mesh=None) -> dict[str, dict]:
    """The same random params stacked, and with one tree per layer."""
    return {
        "stacked": init_params(CONFIG, seed=seed, mesh=mesh),
        "per layer": unstack_layers(init_params(CONFIG, seed=seed, mesh=mesh)),
    }


def test_the_loop_gives_the_scans_logits_and_cache():
    stacked = init_params(CONFIG, seed=3)
    logits, cache = run(stacked)

    loop_logits, loop_cache = run(unstack_layers(init_params(CONFIG, seed=3)))

    np.testing.assert_allclose(loop_logits, logits, rtol=1e-5, atol=1e-5)
    for loop_array, array in zip(jax.tree.leaves(loop_cache), jax.tree.leaves(cache), strict=True):
        np.testing.assert_allclose(loop_array, array, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(array[:, 3, :5])).min(axis=(-1, -2)).all()  # every layer wrote


def test_the_loop_traces_and_lowers_one_layer_called_once_per_layer():
    """Start-up time: a step's trace and lowering do not grow with the number of layers."""
    params = unstack_layers(init_params(CONFIG, seed=0))
    cache = allocate_kv_cache(CONFIG, num_blocks=4, block_size=8)

    text = jax.jit(forward, static_argnums=1).lower(params, CONFIG, cache, INPUTS).as_text()

    assert len(re.findall(r"func\.func private @apply_layer\b", text)) == 1
    assert len(re.findall(r"call @apply_layer\(", text)) == CONFIG.num_layers


@pytest.mark.parametrize("layout", ["stacked", "per layer"])
def test_fused_projections_give_the_same_logits_and_cache(layout):
    params = layouts(seed=4)[layout]
    logits, cache = run(params)

    fused = fuse_projections(params)

    assert is_fused(fused) and not is_fused(params)  # a new tree; the old one is unchanged
    fused_logits, fused_cache = run(fused)
    np.testing.assert_allclose(fused_logits, logits, rtol=1e-6, atol=1e-6)
    for got, expected in zip(jax.tree.leaves(fused_cache), jax.tree.leaves(cache), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["stacked", "per layer"])
def test_unfusing_gives_back_the_params_exactly(layout):
    params = layouts(seed=5)[layout]

    restored = unfuse_projections(fuse_projections(params))

    assert jax.tree.structure(restored) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, restored, params)


@pytest.mark.parametrize("layout", ["stacked", "per layer"])
def test_each_device_fuses_its_own_heads_and_columns(layout):
    """Under TP=2 each fused weight is sharded as param_specs says, and a device's block of it
    holds that device's blocks of q, k, v (gate, up): fusing moved nothing between devices."""
    mesh = make_mesh(2)
    params = layouts(seed=6, mesh=mesh)[layout]

    fused = fuse_projections(params)

    specs = param_specs(CONFIG, scan_layers=layout == "stacked", fused=True)
    assert jax.tree.structure(fused) == jax.tree.structure(specs)
    for array, spec in zip(jax.tree.leaves(fused), jax.tree.leaves(specs), strict=True):
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)
    name = "layers" if layout == "stacked" else "layers_2"
    attn, fused_attn = params[name]["attn"], fused[name]["attn"]
    mlp, fused_mlp = params[name]["mlp"], fused[name]["mlp"]
    for device in range(2):

        def block(array, device=device):
            return np.asarray(array.addressable_shards[device].data)

        qkv = block(fused_attn["qkv_proj"])  # [..., D, K / 2, G + 2, H]
        q = block(attn["q_proj"])  # [..., D, N / 2, H]
        np.testing.assert_array_equal(qkv[..., :GROUP, :].reshape(q.shape), q)
        np.testing.assert_array_equal(qkv[..., GROUP, :], block(attn["k_proj"]))
        np.testing.assert_array_equal(qkv[..., GROUP + 1, :], block(attn["v_proj"]))
        gate_up = block(fused_mlp["gate_up_proj"])  # [..., D, 2, F / 2]
        np.testing.assert_array_equal(gate_up[..., 0, :], block(mlp["gate_proj"]))
        np.testing.assert_array_equal(gate_up[..., 1, :], block(mlp["up_proj"]))
