"""SamplingParams: every invalid value names its field; valid ones construct and normalize."""

import math

import pytest

from jaxllm.sampling_params import SamplingParams

INVALID = [
    ("temperature", -0.1),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "1.0"),
    ("temperature", True),
    ("temperature", None),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", "5"),
    ("top_k", False),
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
    ("max_tokens", None),
    ("min_tokens", -1),
    ("min_tokens", 65),  # more than the default max_tokens (64)
    ("min_tokens", 1.0),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, 2.0]),
    ("stop_token_ids", ["7"]),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.0),
    ("seed", "42"),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


VALID = [
    {},
    {"temperature": 0},
    {"temperature": 0.0, "top_k": 1},
    {"temperature": 2.5, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
    {"top_p": 1.0, "min_p": 1.0},
    {"top_p": 1e-6, "min_p": 0.0},
    {"max_tokens": 1, "min_tokens": 1},
    {"max_tokens": 10, "min_tokens": 10, "ignore_eos": True},
    {"stop": ["a", "bc"], "stop_token_ids": [0, 151645]},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"skip_special_tokens": False},
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


def test_greedy_and_seed():
    assert SamplingParams(temperature=0).greedy
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
