"""The engine's inputs end to end: vLLM's prompt dicts run as their token ids, every bit of a
64-bit seed selects its stream, and (a property test) any prompt and SamplingParams either run
or are refused with an error naming the argument, after which the engine answers as before."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.engine import assert_idle, greedy_params
from support.hf import VOCAB_SIZE

from jaxllm import LLM, SamplingParams

GOOD_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
# Valid requests run with at most this many tokens, to keep the property test fast.
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    """The fixed greedy call's tokens, before any input below was tried."""
    return llm.generate([GOOD_PROMPT], greedy_params(4), use_tqdm=False)[0].token_ids


def assert_usable(llm: LLM, reference: list[int]) -> None:
    assert_idle(llm)
    (output,) = llm.generate([GOOD_PROMPT], greedy_params(4), use_tqdm=False)
    assert output.token_ids == reference
    assert_idle(llm)


def test_prompt_dicts_run_as_their_token_ids_and_text(llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    (expected,) = llm.generate(GOOD_PROMPT, params, use_tqdm=False)
    forms = [
        {"prompt_token_ids": GOOD_PROMPT},
        [{"prompt_token_ids": np.array(GOOD_PROMPT)}],
        ({"prompt_token_ids": tuple(GOOD_PROMPT)},),
    ]
    for form in forms:
        (output,) = llm.generate(form, params, use_tqdm=False)
        assert (output.token_ids, output.prompt_token_ids) == (expected.token_ids, GOOD_PROMPT)
    text, tokens = llm.generate(["\x05\x06", {"prompt": "\x05\x06"}], params, use_tqdm=False)
    assert text.token_ids == tokens.token_ids and tokens.prompt == "\x05\x06"


@pytest.mark.parametrize(
    ("seed", "other"),
    [(5, 5 + 2**32), (1, 2**32), (2**32 + 7, 2**33 + 4), (2**64 - 1, 2**63 - 1)],
    ids=["high-word", "same-fold", "same-fold-high", "top-bit"],
)
def test_every_bit_of_a_seed_selects_its_stream(llm, seed, other):
    def tokens(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return llm.generate([GOOD_PROMPT], params, use_tqdm=False)[0].token_ids

    first = tokens(seed)
    assert tokens(seed) == first
    assert tokens(other) != first


# Numbers of every kind: small and huge ints, floats with NaN and inf, numpy scalars.
NUMBERS = st.one_of(
    st.integers(-2, 5),
    st.integers(),
    st.integers(2**62, 2**66),
    st.floats(-1.0, 2.0),
    st.floats(),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.floats(width=32).map(np.float32),
    st.floats(0.0, 1.0).map(np.float64),
)
VALUES = st.one_of(
    NUMBERS,
    st.none(),
    st.booleans(),
    st.booleans().map(np.bool_),
    st.text(max_size=3),
    st.binary(max_size=2),
    st.lists(st.one_of(st.integers(-1, 300), st.text(max_size=2), st.booleans()), max_size=3),
)
FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")]
# NOTE: half the draws keep the default params, so the prompts get tried too.
SAMPLING_FIELDS = st.one_of(
    st.just({}), st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=2)
)

TOKEN_IDS = st.lists(st.integers(-2, VOCAB_SIZE + 4), max_size=6)
ONE_PROMPT = st.one_of(
    st.text(max_size=4),
    TOKEN_IDS,
    TOKEN_IDS.map(tuple),
    TOKEN_IDS.map(np.array),
    TOKEN_IDS.map(lambda ids: np.array(ids, np.float32)),
    TOKEN_IDS.map(lambda ids: np.array([ids])),  # 2-d
    st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=6),
    st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=6).map(
        lambda ids: {"prompt_token_ids": ids}
    ),
    st.dictionaries(
        st.sampled_from(["prompt", "prompt_token_ids", "cache_salt", 0]),
        st.one_of(st.text(max_size=3), TOKEN_IDS),
        max_size=2,
    ),
    st.lists(st.one_of(st.booleans(), st.floats(), TOKEN_IDS), min_size=1, max_size=3),
    st.binary(max_size=3),
    st.sets(st.integers(0, 10), max_size=3),
    st.one_of(st.none(), st.integers(), st.floats()),
)
PROMPTS = st.one_of(
    ONE_PROMPT,
    st.lists(ONE_PROMPT, max_size=3),
    st.lists(ONE_PROMPT, max_size=2).map(tuple),
    st.frozensets(st.text(max_size=2), max_size=2),
)
# What a refusal names: the prompt's index, the prompts, or the SamplingParams field.
NAMED = re.compile(r"(prompt \d+: |prompts must |SamplingParams\.(\w+) must be )")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=PROMPTS, fields=SAMPLING_FIELDS)
def test_every_input_runs_or_is_refused_naming_it(llm, reference, prompts, fields):
    try:
        params = SamplingParams(**fields)
    except ValueError as error:
        named = NAMED.match(str(error))
        assert named and named.group(2) in fields, str(error)
        event("SamplingParams refused")
        return
    for name, value in dataclasses.asdict(params).items():
        assert type(value) in (int, float, bool, tuple, type(None)), name
    params = dataclasses.replace(
        params,
        max_tokens=min(params.max_tokens or MAX_TOKENS, MAX_TOKENS),
        min_tokens=min(params.min_tokens, MAX_TOKENS),
    )
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, TypeError) as error:
        named = NAMED.match(str(error))
        assert named and named.group(2) is None, str(error)
        event(f"generate refused: {named.group(1)[:7]}")
        assert_usable(llm, reference)
        return
    event("ran")
    for output in outputs:
        assert 1 <= len(output.token_ids) <= MAX_TOKENS
        assert all(0 <= token < VOCAB_SIZE for token in output.token_ids)
    assert_idle(llm)
