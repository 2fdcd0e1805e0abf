"""The layer loop (`scan_layers=False`): one weight buffer per layer, one traced layer."""

from __future__ import annotations

import re

import jax
import numpy as np

from jaxllm.model.config import Qwen3Config
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.layouts import unstack_layers
from jaxllm.model.qwen3 import forward, init_params

from .helpers import Chunk, build_inputs

CONFIG = Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=5,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    dtype="float32",
)
INPUTS = build_inputs(
    [Chunk([1, 2, 3, 4, 5], 0, [3]), Chunk([9, 8, 7], 0, [1])], 8, tile_size=4, table_width=1
)


def run(params, inputs=INPUTS):
    step = jax.jit(forward, static_argnums=1)
    return step(params, CONFIG, allocate_kv_cache(CONFIG, num_blocks=4, block_size=8), inputs)


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
