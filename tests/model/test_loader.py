"""Loading Hugging Face checkpoints: the table, its checks (names, shapes, dtypes, index files,
size) and their error messages."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from support.hf import HFModel, random_qwen3

import jaxllm
from jaxllm.model import checkpoint as checkpoint_module
from jaxllm.model import loader
from jaxllm.model.checkpoint import load_params
from jaxllm.model.config import Qwen3Config
from jaxllm.model.loader import INDEX_FILE, CheckpointError, load_hf_checkpoint
from jaxllm.model.qwen3 import abstract_params, sharded_param_shapes
from jaxllm.model.sharding import make_mesh
from jaxllm.weights import from_hf_names


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tied")
    random_qwen3(
        tied=True, num_heads=4, num_kv_heads=2, head_dim=64, hidden=128, layers=2
    ).save_pretrained(path)
    return path


@pytest.fixture
def checkpoint(tied_checkpoint, tmp_path) -> Path:
    """A private copy of the tied checkpoint, free to break."""
    return Path(shutil.copytree(tied_checkpoint, tmp_path / "copy"))


def rewrite(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


def test_loaded_params_match_the_model_tree(hf_model: HFModel):
    shapes = abstract_params(hf_model.config)
    same = jax.tree.map(
        lambda p, s: p.shape == s.shape and p.dtype == s.dtype, hf_model.params, shapes
    )
    assert all(jax.tree.leaves(same))
    assert ("lm_head" in hf_model.params) != hf_model.config.tie_word_embeddings
    assert (hf_model.path / INDEX_FILE).exists() == hf_model.name.endswith("sharded")


def test_one_error_names_every_missing_unmapped_and_misshaped_tensor(checkpoint):
    def corrupt(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(32, np.float32)
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(32, np.float32)

    rewrite(checkpoint, corrupt)

    with pytest.raises(CheckpointError) as error:
        load_hf_checkpoint(checkpoint)
    message = str(error.value)
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in message
    assert "unmapped tensor model.layers.0.self_attn.rotary_emb.inv_freq" in message
    assert "model.layers.0.self_attn.q_norm.weight has shape (32,), expected (64,)" in message


def test_untied_checkpoint_without_lm_head_is_missing_it(checkpoint):
    edit_config(checkpoint, tie_word_embeddings=False)

    with pytest.raises(CheckpointError, match=r"missing tensor lm_head\.weight"):
        load_hf_checkpoint(checkpoint)


def test_tied_checkpoint_may_carry_lm_head(checkpoint):
    _, without = load_hf_checkpoint(checkpoint)

    def add_lm_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    rewrite(checkpoint, add_lm_head)
    _, with_head = load_hf_checkpoint(checkpoint)

    assert "lm_head" not in with_head
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, without, with_head)))


def test_tied_checkpoint_may_store_its_embedding_as_lm_head(checkpoint):
    """As `safetensors.torch.save_model` writes a tied model (transformers loads it)."""
    _, stored_as_embedding = load_hf_checkpoint(checkpoint)

    def rename(tensors):
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")

    rewrite(checkpoint, rename)
    _, stored_as_lm_head = load_hf_checkpoint(checkpoint)

    assert "lm_head" not in stored_as_lm_head
    assert jax.tree.all(jax.tree.map(np.array_equal, stored_as_embedding, stored_as_lm_head))
    config = Qwen3Config.from_hf(checkpoint)  # and by name, as `LLM.update_params` takes them
    shapes = sharded_param_shapes(config, make_mesh(1))
    named = from_hf_names(load_file(checkpoint / "model.safetensors"), config, shapes)
    assert jax.tree.all(jax.tree.map(np.array_equal, stored_as_embedding, named))
    edit_config(checkpoint, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.embed_tokens\.weight"):
        load_hf_checkpoint(checkpoint)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
            "Qwen3MoeForCausalLM",
        ),
    ],
)
def test_unsupported_architecture_is_named(checkpoint, changes, named):
    edit_config(checkpoint, **changes)

    with pytest.raises(ValueError, match=f"unsupported architecture {named}"):
        load_params(checkpoint)


def test_directory_that_is_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="neither a Hugging Face checkpoint"):
        load_params(tmp_path)


def test_dtype_conversion_both_ways(checkpoint):
    default_config, _ = load_hf_checkpoint(checkpoint)
    assert default_config.dtype == ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    config, params = load_hf_checkpoint(checkpoint, dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}

    def to_bfloat16(tensors):
        for name, tensor in tensors.items():
            tensors[name] = tensor.astype(jnp.bfloat16)

    rewrite(checkpoint, to_bfloat16)
    edit_config(checkpoint, dtype="bfloat16")
    config32, params32 = load_hf_checkpoint(checkpoint, dtype="float32")

    assert config32.dtype == "float32"
    np.testing.assert_array_equal(params32["embed"], np.asarray(params["embed"], np.float32))


def test_a_float64_checkpoint_loads_in_the_dtype_asked_for(checkpoint):
    """jaxllm runs no float64: such a checkpoint is refused naming config.json and dtype=,
    and read converted with dtype= (float32 here: the same values, as they came from it)."""
    _, float32_params = load_hf_checkpoint(checkpoint)

    def to_float64(tensors):
        for name, tensor in tensors.items():
            tensors[name] = tensor.astype(np.float64)

    rewrite(checkpoint, to_float64)
    edit_config(checkpoint, dtype="float64", torch_dtype="float64")
    refused = r"config.json has dtype 'float64', which jaxllm does not run; pass dtype= one of"
    for start in (load_params, checkpoint_module.load_config, jaxllm.LLM):
        with pytest.raises(ValueError, match=refused):
            start(str(checkpoint))
    assert checkpoint_module.check_checkpoint(checkpoint, "float32").dtype == "float32"
    assert checkpoint_module.load_config(checkpoint, "bfloat16").dtype == "bfloat16"
    config, params = load_params(str(checkpoint), "float32")
    assert config.dtype == "float32"
    jax.tree.map(np.testing.assert_array_equal, params, float32_params)


def test_integer_and_bool_tensors_are_named_before_any_data_is_read(checkpoint, monkeypatch):
    def to_integers(tensors):
        name = "model.layers.0.self_attn.q_norm.weight"
        tensors[name] = tensors[name].astype(np.int32)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] > 0

    rewrite(checkpoint, to_integers)
    monkeypatch.setattr(loader, "_read_into", lambda *_: pytest.fail("data was read"))

    with pytest.raises(CheckpointError) as error:
        load_hf_checkpoint(checkpoint)
    message = str(error.value)
    assert "model.layers.0.self_attn.q_norm.weight has dtype I32, expected one of F32" in message
    assert "model.norm.weight has dtype BOOL, expected one of F32, BF16, F16" in message
    assert message.count("has dtype") == 2


def write_index(path: Path, files: dict[str, str]) -> None:
    """An index mapping every tensor to model.safetensors but `files`' (tensor -> file name)."""
    with safe_open(path / "model.safetensors", framework="numpy") as handle:
        weight_map = dict.fromkeys(handle.keys(), "model.safetensors") | files
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_names_outside_the_directory_or_missing_are_refused(checkpoint, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(checkpoint / "model.safetensors", outside / "shard.safetensors")
    (checkpoint / "linked").symlink_to(outside, target_is_directory=True)
    names = {
        "model.norm.weight": "../outside/shard.safetensors",
        "model.embed_tokens.weight": str(outside / "shard.safetensors"),
        "model.layers.0.input_layernorm.weight": "linked/shard.safetensors",
        "model.layers.1.input_layernorm.weight": "missing.safetensors",
    }
    write_index(checkpoint, names)

    with pytest.raises(CheckpointError) as error:
        load_params(checkpoint)
    problems = [line.strip() for line in str(error.value).splitlines()[1:]]
    *outside_names, missing = names.values()
    assert sorted(problems) == sorted(
        [f"{INDEX_FILE} names {name!r}, outside {checkpoint}" for name in outside_names]
        + [f"{INDEX_FILE} names {missing!r}, which is not a file in {checkpoint}"]
    )


def test_a_shard_that_is_no_safetensors_and_an_index_without_a_map_are_named(checkpoint):
    shard = checkpoint / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:6])  # cut short
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a safetensors file"):
        load_params(checkpoint)
    for index in ({"metadata": {}}, {"weight_map": {"model.norm.weight": None}}):
        (checkpoint / INDEX_FILE).write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match=f"{INDEX_FILE} holds no weight_map"):
            load_params(checkpoint)


def test_shards_linked_from_a_cache_load(checkpoint, tmp_path):
    """The Hugging Face cache's layout: a snapshot's files link to blobs elsewhere."""
    _, expected = load_hf_checkpoint(checkpoint)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.move(checkpoint / "model.safetensors", blobs / "3f2a")
    (checkpoint / "model.safetensors").symlink_to(blobs / "3f2a")
    write_index(checkpoint, {})

    _, params = load_params(checkpoint)

    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, params, expected)))


def test_a_model_too_large_for_memory_is_refused_at_once(checkpoint, monkeypatch):
    edit_config(checkpoint, num_hidden_layers=10**6, intermediate_size=10**5)
    monkeypatch.setattr(checkpoint_module, "load_hf_checkpoint", lambda *_, **__: pytest.fail())

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"take [\d.]+ GB .*, more than the [\d.]+ GB available"):
        load_params(checkpoint)
    assert time.perf_counter() - start < 1.0


def test_start_up_refuses_a_model_too_large_before_listing_its_tensors(checkpoint, monkeypatch):
    """The tensors' check grows with the config's layers (minutes at 10^6): start-up checks the
    params' size first."""
    edit_config(checkpoint, num_hidden_layers=10**6, intermediate_size=10**5)
    monkeypatch.setattr(checkpoint_module, "check_hf_checkpoint", lambda *_: pytest.fail())

    with pytest.raises(ValueError, match=r"the params \(1000000 layers .* more than the"):
        jaxllm.LLM(checkpoint, dtype="float32")


def test_a_checkpoint_error_lists_its_first_problems(checkpoint):
    edit_config(checkpoint, num_hidden_layers=100)

    with pytest.raises(CheckpointError) as error:
        load_params(checkpoint)

    lines = str(error.value).splitlines()[1:]
    assert len(lines) == loader.MAX_PROBLEMS_SHOWN + 1
    assert lines[0] == "  missing tensor model.layers.10.input_layernorm.weight"
    assert re.fullmatch(r"  \.\.\. and \d+ more", lines[-1])
