"""The model's layer loop: one traced layer whatever the depth, params sharded as declared, and
small decode steps run on padding rows."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from support.inputs import Chunk, build_inputs, relative_error, small_config

from jaxllm.model import layers
from jaxllm.model.attention import Kernels
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


@pytest.mark.parametrize(
    "kernels", [Kernels(), Kernels(decode="pallas", interpret=True)], ids=["jnp", "pallas"]
)
def test_a_small_decode_step_on_padding_rows_gives_its_own_logits_and_cache(monkeypatch, kernels):
    """Kernels' `decode_rows`: a decode step of 2 rows runs its matmuls on 8 and its attention
    on its own 2, with the logits and the cache writes of the 2-row step (jax.numpy, and the
    GPU's Pallas kernels interpreted)."""
    on_8_rows = dataclasses.replace(kernels, decode_rows=8)
    attended, own_attend = set(), layers.attend

    def attend(q, *args):
        attended.add(q.shape[0])
        return own_attend(q, *args)

    monkeypatch.setattr(layers, "attend", attend)
    params = init_params(CONFIG, seed=0)
    cache = allocate_kv_cache(CONFIG, num_blocks=4, block_size=8)
    prefill = jax.jit(forward, static_argnums=1)
    _, cache = prefill(params, CONFIG, cache, INPUTS)
    decode = build_inputs([Chunk([11], 5, [3]), Chunk([12], 3, [1])], 8, 1, table_width=1)
    attended.clear()
    step = jax.jit(forward, static_argnums=(1, 4))

    def matmul_rows(kernels: Kernels) -> set[int]:
        jaxpr = jax.make_jaxpr(forward, static_argnums=(1, 4))(
            params, CONFIG, cache, decode, kernels
        )
        text = str(jaxpr)  # the layers' matmuls: dot_generals of [rows, hidden] activations
        return {
            int(rows)
            for rows in re.findall(rf"f32\[(\d+),{CONFIG.hidden_size}\] = dot_general", text)
        }

    assert matmul_rows(on_8_rows) == {8} and matmul_rows(kernels) == {2}
    assert attended == {2}
    padded_logits, padded = step(params, CONFIG, cache, decode, on_8_rows)
    logits, expected = step(params, CONFIG, cache, decode, kernels)
    assert padded_logits.shape == logits.shape == (2, CONFIG.vocab_size)
    assert relative_error(padded_logits, logits) <= 1e-5
    for actual, wanted in ((padded.keys, expected.keys), (padded.values, expected.values)):
        assert relative_error(actual, wanted) <= 1e-6
    # Padding rows write nothing: the slots the step did not write are as before.
    written = np.zeros(np.asarray(cache.keys).shape[:3], bool)  # [L, NB, BS]
    written[:, [3, 1], [5, 3]] = True
    assert (np.asarray(padded.keys)[~written] == np.asarray(cache.keys)[~written]).all()
