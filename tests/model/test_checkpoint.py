"""Orbax round trips and `load_params` over its three kinds of source."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.hf import HFModel
from support.inputs import Chunk, build_inputs

from jaxllm.model.checkpoint import load_params, save_params
from jaxllm.model.config import PRESETS
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.qwen3 import abstract_params, forward


def bitwise_equal(a: jax.Array, b: jax.Array) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_is_bit_identical(hf_model: HFModel, tmp_path, dtype):
    config = hf_model.config.replace(dtype=dtype)
    params = jax.tree.map(lambda p: p.astype(dtype), hf_model.params)
    save_params(tmp_path / "ckpt", config, params)

    loaded_config, loaded = load_params(tmp_path / "ckpt", dtype=dtype)

    assert loaded_config == config
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    assert all(jax.tree.leaves(jax.tree.map(bitwise_equal, loaded, params)))


def test_orbax_load_casts_to_the_asked_dtype(hf_model: HFModel, tmp_path):
    save_params(tmp_path / "ckpt", hf_model.config, hf_model.params)

    config, params = load_params(tmp_path / "ckpt", dtype="bfloat16")

    assert config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


def test_random_preset_is_seeded_and_runs():
    config, params = load_params("random:qwen3-tiny", seed=1)
    _, same = load_params("random:qwen3-tiny", seed=1)
    _, other = load_params("random:qwen3-tiny", seed=2)

    shapes = abstract_params(config)
    assert jax.tree.map(lambda p: (p.shape, p.dtype), params) == jax.tree.map(
        lambda s: (s.shape, s.dtype), shapes
    )
    qkv = lambda tree, i: tree[f"layers_{i}"]["attn"]["qkv_proj"]
    assert bitwise_equal(qkv(params, 1), qkv(same, 1))
    assert not bitwise_equal(qkv(params, 1), qkv(other, 1))
    assert not bitwise_equal(qkv(params, 0), qkv(params, 1))  # each layer draws its own
    np.testing.assert_array_equal(params["final_norm"]["scale"], 1.0)

    cache = allocate_kv_cache(config, num_blocks=4, block_size=16)
    inputs = build_inputs([Chunk([1, 2, 3], 0, [2])], 16, tile_size=4, table_width=2)
    logits, _ = forward(params, config, cache, inputs)
    assert logits.shape == (3, PRESETS["qwen3-tiny"].vocab_size)
    assert np.isfinite(np.asarray(logits)).all()


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown preset 'qwen3-7b'.*qwen3-8b"):
        load_params("random:qwen3-7b")
