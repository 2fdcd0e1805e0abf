"""SamplingParams and EngineConfig: every invalid value names its field; valid ones (numpy
scalars included) construct and normalize to Python values."""

import dataclasses
import functools
import logging
import math

import numpy as np
import pytest

from jaxllm.cache import LRUPolicy
from jaxllm.config import EngineConfig
from jaxllm.sampling_params import MIN_TEMPERATURE, SamplingParams, StructuredOutputsParams

INVALID = [
    ("temperature", -0.1),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "1.0"),
    ("temperature", True),
    ("temperature", None),
    ("temperature", 10**400),  # too large for a float
    ("temperature", 1e39),  # inf in float32, as the device computes
    ("repetition_penalty", 1e39),
    ("logit_bias", {7: -1e39}),
    ("logit_bias", {"²": 1.0}),  # a digit, but no decimal one
    ("temperature", np.bool_(True)),
    ("temperature", np.float32("nan")),
    ("temperature", 1j),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "5"),
    ("top_k", False),
    ("top_k", np.float64(5)),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", None),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 65),  # more than the default max_tokens (64)
    ("min_tokens", 1.0),
    ("ignore_eos", "no"),
    ("ignore_eos", 0),
    ("ignore_eos", None),
    ("skip_special_tokens", "yes"),
    ("skip_special_tokens", 1),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop", b"ok"),
    ("stop", {"ok": 1}),
    ("stop", ["ok", "\ud800"]),  # a lone surrogate: no text a model writes
    ("bad_words", ["\udcff"]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, 2.0]),
    ("stop_token_ids", ["7"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("stop_token_ids", np.array([[1, 2]])),
    ("seed", -2),
    ("seed", np.int64(-2)),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", "42"),
    ("seed", True),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 8.0),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r:.20}" for f, v in INVALID])
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*, got "):
        SamplingParams(**{field: value})


VALID = [
    {},
    {"temperature": 0},
    {"temperature": 0.01, "top_k": 1},
    {"temperature": 2.5, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
    {"top_p": 1.0, "min_p": 1.0},
    {"top_p": 1e-6, "min_p": 0.0},
    {"max_tokens": 1, "min_tokens": 1},
    {"max_tokens": 10, "min_tokens": 10, "ignore_eos": True},
    {"stop": ["a", "bc"], "stop_token_ids": [0, 151645]},
    {"seed": 0},
    {"seed": 2**63},
    {"seed": 2**64 - 1},
    {"skip_special_tokens": False},
    {"truncate_prompt_tokens": 1},
    {"truncate_prompt_tokens": -1},
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k) for k in VALID])
def test_valid_values_construct(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(params, name) == expected


def test_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["x", "y"]).stop == ("x", "y")
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)
    assert SamplingParams().stop is None


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams()


def test_seed_minus_one_means_none():  # vLLM's rule
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=np.int64(-1)) == SamplingParams()


def test_a_temperature_below_vllms_floor_is_raised_to_it(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxllm.sampling_params"):
        params = SamplingParams(temperature=1e-6)
    assert params.temperature == MIN_TEMPERATURE == 0.01 and not params.greedy
    assert "temperature=1e-06 is raised to 0.01" in caplog.text
    assert SamplingParams(temperature=np.float32(0.005)).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).temperature == 0.0
    assert SamplingParams(temperature=0.01).temperature == 0.01


def test_greedy_and_seed():
    assert SamplingParams(temperature=0).greedy
    greedy = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)  # off, as vLLM sets them
    assert greedy == SamplingParams(temperature=0)
    assert not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(seed=7).sampling_seed == 7
    assert SamplingParams().sampling_seed == 0
    derived = SamplingParams(_derived_seed=99)
    assert derived.sampling_seed == 99 and derived == SamplingParams()
    assert SamplingParams(seed=7, _derived_seed=99).sampling_seed == 7


def test_is_frozen_and_hashable():
    params = SamplingParams(stop=["x"])
    with pytest.raises(AttributeError):
        params.temperature = 0.0  # type: ignore[misc]
    assert hash(params) == hash(SamplingParams(stop="x"))


def test_numpy_scalars_are_stored_as_python_values():
    params = SamplingParams(
        temperature=np.float32(0.5),
        top_k=np.int32(-1),
        top_p=np.float64(0.9),
        min_p=np.float16(0.25),
        max_tokens=np.int64(8),
        min_tokens=np.uint8(2),
        ignore_eos=np.bool_(True),
        stop=np.array(["x", "yz"]),
        stop_token_ids=[np.int64(3), 4],
        seed=np.uint64(2**64 - 1),
        skip_special_tokens=np.bool_(False),
    )
    expected = SamplingParams(
        temperature=0.5, top_k=0, top_p=float(np.float64(0.9)), min_p=0.25, max_tokens=8,
        min_tokens=2, ignore_eos=True, stop=("x", "yz"), stop_token_ids=(3, 4),
        seed=2**64 - 1, skip_special_tokens=False,
    )  # fmt: skip
    assert params == expected and hash(params) == hash(expected)
    for field in dataclasses.fields(SamplingParams):
        value = getattr(params, field.name)
        assert type(value) in (int, float, bool, tuple, type(None)), field.name
    assert {type(s) for s in params.stop} == {str}
    assert {type(t) for t in params.stop_token_ids} == {int}


def test_structured_outputs_flags_are_stored_as_python_bools():
    params = StructuredOutputsParams(json_object=np.bool_(True), disable_any_whitespace=np.bool_(0))
    assert (params.json_object, params.disable_any_whitespace) == (True, False)
    assert {type(params.json_object), type(params.disable_any_whitespace)} == {bool}


def test_a_large_number_is_refused_with_a_short_message():
    with pytest.raises(ValueError, match=r"got <an int of \d+ bits>$"):
        SamplingParams(top_p=10**5000)


ENGINE_INVALID = [
    ("tensor_parallel_size", 3),
    ("tensor_parallel_size", 2.0),
    ("max_num_seqs", 0),
    ("max_num_seqs", True),
    ("max_num_seqs", "8"),
    ("max_num_batched_tokens", -5),
    ("max_num_batched_tokens", 2**40),
    ("max_model_len", 1),
    ("max_model_len", 4096.0),
    ("kvcache_block_size", 24),
    ("kvcache_block_size", 4),
    ("kvcache_block_size", 16.0),
    ("num_kvcache_blocks", 0),
    ("num_kvcache_blocks", 1.5),
    ("gpu_memory_utilization", 0.0),
    ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", math.nan),
    ("gpu_memory_utilization", "0.5"),
    ("gpu_memory_utilization", True),
    ("dtype", "float16"),
    ("dtype", np.float32),
    ("enable_prefix_caching", "no"),
    ("enable_prefix_caching", 1),
    ("eviction_policy", "random"),
    ("eviction_policy", 3),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
    ("compile_at_startup", "yes"),
    ("compile_at_startup", 0),
    ("max_logprobs", 0),
    ("logprobs_mode", "processed_logits"),
    ("logprobs_mode", None),
]


@pytest.mark.parametrize(
    ("field", "value"), ENGINE_INVALID, ids=[f"{f}={v!r}" for f, v in ENGINE_INVALID]
)
def test_invalid_engine_setting_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got "):
        EngineConfig(**{field: value})


def test_engine_settings_take_numpy_scalars_and_policies():
    config = EngineConfig(
        tensor_parallel_size=np.int64(2),
        max_num_seqs=np.int32(4),
        max_num_batched_tokens=np.uint16(64),
        max_model_len=np.int64(256),
        kvcache_block_size=np.int64(16),
        num_kvcache_blocks=np.int64(32),
        gpu_memory_utilization=np.float32(0.5),
        dtype=np.str_("float32"),
        enable_prefix_caching=np.bool_(False),
        eviction_policy="LFU",
        seed=np.uint64(7),
        compile_at_startup=np.bool_(True),
    )
    assert config == EngineConfig(
        tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
        kvcache_block_size=16, num_kvcache_blocks=32, gpu_memory_utilization=0.5, dtype="float32",
        enable_prefix_caching=False, eviction_policy="LFU", seed=7, compile_at_startup=True,
    )  # fmt: skip
    assert type(config.max_num_seqs) is int and type(config.gpu_memory_utilization) is float
    assert type(config.enable_prefix_caching) is bool and type(config.dtype) is str
    policy = LRUPolicy()
    assert EngineConfig(eviction_policy=policy).eviction_policy is policy


def test_compile_at_startup_defaults_to_the_platform():
    assert EngineConfig().compile_at_startup is None
    assert EngineConfig(compile_at_startup=False).compile_at_startup is False


@pytest.mark.parametrize(
    "schema",
    [
        "[" * 100_000 + "]" * 100_000,
        functools.reduce(lambda inner, _: {"items": inner}, range(5_000), {}),
    ],
)
def test_a_schema_nested_past_pythons_recursion_limit_is_a_value_error(schema):
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.json is nested too deeply"):
        StructuredOutputsParams(json=schema)
