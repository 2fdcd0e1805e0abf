"""Loading Hugging Face checkpoints: the table, its checks and their error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.hf import HFModel, random_qwen3

from jaxllm.model.checkpoint import load_params
from jaxllm.model.loader import INDEX_FILE, CheckpointError, load_hf_checkpoint
from jaxllm.model.qwen3 import abstract_params


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
