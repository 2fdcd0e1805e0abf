"""Qwen3Config: reading HF config.json, field checks, presets and their published parameter
counts, and the params' bytes per device."""

from __future__ import annotations

import json
import math
import re
import time

import jax
import pytest

from jaxllm.model.config import PRESETS, Qwen3Config, param_bytes
from jaxllm.model.qwen3 import abstract_params, param_count, param_shardings
from jaxllm.model.sharding import make_mesh

HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "hidden_act": "silu",
}

# preset -> (total, non-embedding) parameters as published (rounded to 2-3 digits)
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, 0.44e9),
    "qwen3-1.7b": (1.7e9, 1.4e9),
    "qwen3-4b": (4.0e9, 3.6e9),
    "qwen3-8b": (8.2e9, 6.95e9),
    "qwen3-14b": (14.8e9, 13.2e9),
    "qwen3-32b": (32.8e9, 31.2e9),
}


def test_from_hf_reads_the_published_0_6b_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))

    config = Qwen3Config.from_hf(tmp_path)

    assert config == PRESETS["qwen3-0.6b"]
    assert Qwen3Config.from_hf(HF_CONFIG) == config


def test_from_hf_reads_transformers_5_rope_parameters():
    hf = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "torch_dtype")}
    hf |= {"rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}, "dtype": "float32"}

    config = Qwen3Config.from_hf(hf)

    assert (config.rope_theta, config.dtype) == (5000.0, "float32")


def test_fields_left_out_take_transformers_defaults():
    """As transformers (and so vLLM) reads the same config.json: a model that leaves out
    head_dim, rope_theta or max_position_embeddings gets Qwen3Config's defaults."""
    from transformers import Qwen3Config as HFQwen3Config

    optional = ("head_dim", "rope_theta", "max_position_embeddings", "rms_norm_eps")
    hf = {k: v for k, v in HF_CONFIG.items() if k not in optional}
    config, reference = Qwen3Config.from_hf(hf), HFQwen3Config(**hf)

    assert config.head_dim == reference.head_dim
    assert config.rope_theta == reference.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == reference.max_position_embeddings
    assert config.rms_norm_eps == reference.rms_norm_eps


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
        ({"architectures": None, "model_type": "qwen3_moe"}, "qwen3_moe"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True, "max_window_layers": 20}, "sliding-window"),
        ({"layer_types": ["full_attention"] * 27 + ["sliding_attention"]}, "sliding-window"),
    ],
)
def test_from_hf_rejects_unsupported_models_by_name(changes, named):
    with pytest.raises(ValueError, match=named):
        Qwen3Config.from_hf(HF_CONFIG | changes)


def test_from_hf_reads_a_window_no_layer_slides():
    """As Qwen3's published configs: the window off, or on from past the last layer."""
    for window in ({"use_sliding_window": False, "max_window_layers": 20},
                   {"use_sliding_window": True, "max_window_layers": 28}):  # fmt: skip
        assert Qwen3Config.from_hf(HF_CONFIG | window) == PRESETS["qwen3-0.6b"]


DEFAULT_ROPE = {"rope_type": "default"}


@pytest.mark.parametrize(
    ("changes", "plain"),
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, True),
        ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_theta": 5e5}}, True),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}, "rope_parameters": DEFAULT_ROPE}, False),
        ({"partial_rotary_factor": 0.5}, False),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 20}, False),
        ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}, True),
        ({"use_sliding_window": True, "layer_types": ["full_attention"] * 28}, True),
        ({"use_sliding_window": True, "sliding_window": 64}, True),  # max_window_layers: 28 of 28
    ],
)  # fmt: skip
def test_from_hf_reads_rope_and_windows_as_transformers_does(changes, plain):
    """Where transformers reads plain RoPE over full attention, its theta; else refused (a
    `rope_scaling` beside `rope_parameters` is the one it reads)."""
    from transformers import Qwen3Config as HFQwen3Config

    hf = HF_CONFIG | changes
    reference = HFQwen3Config(**hf)
    rope = reference.rope_parameters
    assert plain == (
        rope["rope_type"] == "default"
        and rope.get("partial_rotary_factor", 1.0) == 1
        and set(reference.layer_types) == {"full_attention"}
    )
    if plain:
        assert Qwen3Config.from_hf(hf).rope_theta == rope["rope_theta"]
    else:
        with pytest.raises(ValueError, match="unsupported Qwen3 config"):
            Qwen3Config.from_hf(hf)


def test_from_hf_names_a_missing_size_and_a_config_of_another_form(tmp_path):
    without_heads = {k: v for k, v in HF_CONFIG.items() if k != "num_attention_heads"}
    with pytest.raises(ValueError, match=r"config\.json lacks num_attention_heads"):
        Qwen3Config.from_hf(without_heads)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object, got list"):
        Qwen3Config.from_hf(tmp_path)


def test_config_is_hashable_and_frozen():
    config = PRESETS["qwen3-tiny"]
    assert hash(config) == hash(config.replace())
    assert config.replace(dtype="bfloat16") != config
    with pytest.raises(AttributeError):
        config.num_layers = 3


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    total, non_embedding = PUBLISHED[name]
    config = PRESETS[name]
    # NOTE: Qwen3-1.7B has 1.72B parameters (tied); its published "1.7B" is rounded by 1.2%.
    total_tolerance = 0.015 if name == "qwen3-1.7b" else 0.01

    assert param_count(config) == pytest.approx(total, rel=total_tolerance)
    assert param_count(config, non_embedding=True) == pytest.approx(non_embedding, rel=0.01)


def test_abstract_params_allocate_nothing_and_hold_each_layer_apart():
    config = PRESETS["qwen3-32b"]
    shapes = abstract_params(config)

    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(shapes))
    assert {name for name in shapes if name.startswith("layers")} == {
        f"layers_{i}" for i in range(64)
    }
    # 64 query heads over 8 kv heads: for each kv head 8 queries, a key and a value.
    assert shapes["layers_63"]["attn"]["qkv_proj"].shape == (5120, 8, 10, 128)
    assert shapes["layers_0"]["mlp"]["gate_up_proj"].shape == (5120, 2, 25600)
    assert shapes["layers_0"]["mlp"]["down_proj"].shape == (25600, 5120)
    assert shapes["lm_head"].shape == (5120, 151936)
    assert shapes["embed"].dtype == jax.numpy.bfloat16


def test_tiny_preset_is_cpu_sized_with_the_real_vocabulary():
    config = PRESETS["qwen3-tiny"]
    assert config.vocab_size == 151_936 and config.tie_word_embeddings
    assert param_count(config, non_embedding=True) < 10e6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_theta": 0.0}, "Qwen3Config.rope_theta must be a finite number > 0, got 0.0"),
        ({"rope_theta": math.inf}, "Qwen3Config.rope_theta must be a finite number > 0, got inf"),
        ({"rope_theta": math.nan}, "Qwen3Config.rope_theta must be a finite number > 0, got nan"),
        ({"rms_norm_eps": -1e-6}, "Qwen3Config.rms_norm_eps must be a finite number > 0, got"),
        ({"vocab_size": 0}, "Qwen3Config.vocab_size must be an integer >= 1, got 0"),
        ({"hidden_size": -64}, "Qwen3Config.hidden_size must be an integer >= 1, got -64"),
        ({"intermediate_size": 7.5}, "Qwen3Config.intermediate_size must be an integer >= 1"),
        ({"num_layers": -1}, "Qwen3Config.num_layers must be an integer >= 0, got -1"),
        ({"num_heads": 0}, "Qwen3Config.num_heads must be an integer >= 1, got 0"),
        ({"num_kv_heads": 0}, "Qwen3Config.num_kv_heads must be an integer >= 1, got 0"),
        ({"head_dim": True}, "Qwen3Config.head_dim must be an integer >= 1, got True"),
        ({"max_position_embeddings": "4096"}, "Qwen3Config.max_position_embeddings must be"),
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads must be a multiple of num_kv_heads (4)"),
        ({"dtype": "int8"}, "Qwen3Config.dtype must be one of"),
    ],
)
def test_fields_out_of_range_are_named_with_their_value(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PRESETS["qwen3-tiny"].replace(**changes)


def test_from_hf_checks_the_fields_it_reads():
    with pytest.raises(ValueError, match=r"Qwen3Config\.rope_theta .* got -1\.0"):
        Qwen3Config.from_hf(HF_CONFIG | {"rope_theta": -1})
    without_head_dim = {k: v for k, v in HF_CONFIG.items() if k != "head_dim"}
    with pytest.raises(ValueError, match=r"Qwen3Config\.num_heads must be an integer >= 1, got 0"):
        Qwen3Config.from_hf(without_head_dim | {"num_attention_heads": 0})


@pytest.mark.parametrize("tensor_parallel_size", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_param_bytes_is_one_devices_share_of_the_param_tree(tensor_parallel_size, tied, dtype):
    config = PRESETS["qwen3-tiny"].replace(
        num_layers=3, vocab_size=1024, num_kv_heads=4, tie_word_embeddings=tied, dtype=dtype
    )
    shardings = param_shardings(config, make_mesh(tensor_parallel_size))
    per_device = jax.tree.map(
        lambda leaf, sharding: math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize,
        abstract_params(config),
        shardings,
    )

    assert param_bytes(config, tensor_parallel_size) == sum(jax.tree.leaves(per_device))


def test_param_bytes_of_a_million_layers_takes_no_time():
    config = PRESETS["qwen3-0.6b"]
    start = time.perf_counter()
    huge = param_bytes(config.replace(num_layers=10**6))
    elapsed = time.perf_counter() - start

    one_layer = param_bytes(config.replace(num_layers=1)) - param_bytes(
        config.replace(num_layers=0)
    )
    assert one_layer > 0
    assert huge == param_bytes(config.replace(num_layers=0)) + 10**6 * one_layer
    assert elapsed < 0.05  # a closed form: no loop over the layers
