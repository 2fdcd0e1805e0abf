"""Orbax round trips, their manifest, and `load_params` over its three kinds of source and its
memory check."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from support.hf import HFModel
from support.inputs import Chunk, build_inputs, small_config

from jaxllm.model import checkpoint
from jaxllm.model.checkpoint import (
    CONFIG_FILE,
    MANIFEST_FILE,
    PARAMS_DIR,
    available_memory_bytes,
    check_params_fit,
    load_params,
    save_params,
)
from jaxllm.model.config import PRESETS, Qwen3Config, param_bytes
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.loader import CheckpointError
from jaxllm.model.qwen3 import abstract_params, forward, init_params
from jaxllm.model.sharding import make_mesh


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


@pytest.fixture
def saved(tmp_path) -> tuple[Path, Qwen3Config, dict]:
    """A small float32 random model saved by `save_params`: (its directory, config, params)."""
    config = small_config()
    params = init_params(config, seed=0)
    save_params(tmp_path / "saved", config, params)
    return tmp_path / "saved", config, params


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    change(manifest["leaves"])
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_manifest_lists_every_leaf_with_its_shape_and_dtype(saved):
    path, config, params = saved
    leaves = json.loads((path / MANIFEST_FILE).read_text())["leaves"]

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    names = {"/".join(key.key for key in keys): leaf for keys, leaf in flat}
    assert leaves.keys() == names.keys()
    for name, leaf in names.items():
        assert (tuple(leaves[name]["shape"]), leaves[name]["dtype"]) == (leaf.shape, config.dtype)
    for a, b in itertools.combinations(names, 2):  # e.g. the norm scales, all ones, are equal
        same_bytes = np.asarray(names[a]).tobytes() == np.asarray(names[b]).tobytes()
        assert same_bytes == (leaves[a]["xxh3_64"] == leaves[b]["xxh3_64"]), (a, b)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_altered_params_are_named_on_load(saved, tmp_path, dtype):
    path, config, params = saved
    altered = jax.tree.map(lambda p: p, params)
    altered["layers_1"]["mlp"]["down_proj"] = params["layers_1"]["mlp"]["down_proj"].at[0, 0].add(1)
    save_params(tmp_path / "altered", config, altered)
    shutil.rmtree(path / PARAMS_DIR)
    shutil.copytree(tmp_path / "altered" / PARAMS_DIR, path / PARAMS_DIR)

    with pytest.raises(CheckpointError) as error:
        load_params(path, dtype=dtype)

    problems = str(error.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].strip().startswith("layers_1/mlp/down_proj: xxh3_64")


def test_a_manifest_of_other_shapes_or_dtypes_is_refused_before_reading(saved, monkeypatch):
    path, _, _ = saved

    def change(leaves):
        leaves["embed"]["dtype"] = "bfloat16"
        leaves["final_norm/scale"]["shape"] = [7]
        leaves["layers_9/attn_norm/scale"] = leaves.pop("layers_2/attn_norm/scale")

    edit_manifest(path, change)
    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", lambda *_: pytest.fail("read"))

    with pytest.raises(CheckpointError) as error:
        load_params(path)

    message = str(error.value)
    assert "embed: dtype float32, saved as bfloat16" in message
    assert "final_norm/scale: shape [32], saved as [7]" in message
    assert "layers_9/attn_norm/scale: in the manifest, not in the model" in message
    assert "layers_2/attn_norm/scale: in the model, not in the manifest" in message


def test_a_checkpoint_without_manifest_loads_unverified(saved):
    path, config, params = saved
    (path / MANIFEST_FILE).unlink()

    loaded_config, loaded = load_params(path)

    assert loaded_config == config
    assert all(jax.tree.leaves(jax.tree.map(bitwise_equal, loaded, params)))


def test_an_orbax_config_out_of_range_is_refused(saved):
    path, config, _ = saved
    values = dataclasses.asdict(config) | {"rms_norm_eps": -1.0}
    (path / CONFIG_FILE).write_text(json.dumps(values))

    with pytest.raises(ValueError, match=r"Qwen3Config\.rms_norm_eps must be a finite number > 0"):
        load_params(path)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (CONFIG_FILE, {"no_such_size": 1}, "is not a Qwen3Config"),
        (CONFIG_FILE, [1, 2], "is not a Qwen3Config"),
        (MANIFEST_FILE, {}, "holds no leaves"),
    ],
)
def test_a_config_or_manifest_of_another_form_is_named(saved, name, content, message):
    path, _, _ = saved
    (path / name).write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=rf"{name} {message}"):
        load_params(path)


def test_available_memory_reads_meminfo_and_falls_back_to_sysconf(tmp_path, monkeypatch):
    cpu = jax.devices("cpu")[0]
    (tmp_path / "meminfo").write_text("MemTotal: 9999 kB\nMemFree: 10 kB\nMemAvailable: 2048 kB\n")
    monkeypatch.setattr(checkpoint, "MEMINFO", tmp_path / "meminfo")
    assert available_memory_bytes(cpu) == 2048 * 1024

    monkeypatch.setattr(checkpoint, "MEMINFO", tmp_path / "missing")
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available_memory_bytes(cpu) == pytest.approx(pages, rel=0.1)


def test_available_memory_of_an_accelerator_is_its_limit_less_its_use():
    gpu = SimpleNamespace(memory_stats=lambda: {"bytes_limit": 80 << 30, "bytes_in_use": 5 << 30})
    assert available_memory_bytes(gpu) == 75 << 30


def test_cpu_devices_share_the_host_memory(monkeypatch):
    config, mesh = small_config(num_kv_heads=2), make_mesh(2, jax.devices("cpu"))
    both_devices = 2 * param_bytes(config, tensor_parallel_size=2)
    monkeypatch.setattr(checkpoint, "available_memory_bytes", lambda device: both_devices)
    check_params_fit(config, mesh)

    monkeypatch.setattr(checkpoint, "available_memory_bytes", lambda device: both_devices - 1)
    with pytest.raises(ValueError, match=r"GB in host memory, more than the 0\.00 GB available"):
        check_params_fit(config, mesh)


def test_params_that_do_not_fit_are_refused_before_they_are_made(saved, monkeypatch):
    path, _, _ = saved
    monkeypatch.setattr(checkpoint, "available_memory_bytes", lambda device: 1000)
    for maker in ("init_params", "sharded_param_shapes", "load_hf_checkpoint"):
        monkeypatch.setattr(checkpoint, maker, lambda *_, **__: pytest.fail("allocated"))

    tiny_gb = param_bytes(PRESETS["qwen3-tiny"]) / 1e9
    with pytest.raises(ValueError, match=rf"take {tiny_gb:.2f} GB (in host memory|per device)"):
        load_params("random:qwen3-tiny")
    with pytest.raises(ValueError, match=r"more than the 0\.00 GB available"):
        load_params(path)


@pytest.mark.parametrize("name", [CONFIG_FILE, MANIFEST_FILE])
def test_a_file_of_the_checkpoint_that_is_not_json_is_named(saved, name):
    path, _, _ = saved
    (path / name).write_text("{")
    with pytest.raises(ValueError, match=rf"{name} is not valid JSON"):
        load_params(path)


def test_model_files_that_are_not_json_or_name_no_token_ids_are_named(tmp_path):
    from jaxllm.generation_config import eos_token_ids

    (tmp_path / "config.json").write_text('{"architectures": ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        Qwen3Config.from_hf(tmp_path)
    tokenizer = SimpleNamespace(eos_token_id=1)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 3]}')
    assert eos_token_ids(tokenizer, str(tmp_path)) == (1, 2, 3)
    for eos in ('"x"', '"12"', "2.0", "[true]", "[-1]", "[1099511627776]"):
        (tmp_path / "generation_config.json").write_text(f'{{"eos_token_id": {eos}}}')
        with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be"):
            eos_token_ids(tokenizer, str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_an_array_file_cut_short_or_missing_is_a_checkpoint_error(saved, damage):
    path, _, _ = saved
    files = [file for file in (path / PARAMS_DIR).rglob("*") if file.is_file()]
    largest = max(files, key=lambda file: file.stat().st_size)
    if damage == "truncate":
        largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    else:
        largest.unlink()
    with pytest.raises(CheckpointError, match=rf"cannot read the orbax checkpoint {path}: \S"):
        load_params(path)
