"""The logits processors (penalties, logit bias, allowed tokens, bad words) against a plain numpy
reference of vLLM's formulas, in vLLM's order: the bias (-inf outside the allowed tokens and at
banned ones), then the repetition penalty over prompt and output, then the frequency and presence
penalties over the output. Slots are written from the host's rows (`sched.processors.slot_write`)
and updated step by step (`count_tokens`, ban edits), which must equal a slot written anew; rows
of no slot (-1) come back unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.model.inputs import IN_PROMPT
from jaxllm.model.logits_processors import (
    EDIT_CHUNK,
    LogitsProcessors,
    ProcessorState,
    apply_bitmask,
    count_tokens,
    edit_bias,
    process,
    write_slot,
)
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched.processors import (
    ProcessorPlan,
    SequenceProcessors,
    SlotWrite,
    bad_word_ids,
    ban_edits,
    banned_now,
    slot_write,
)
from jaxllm.sched.sequence import Sequence


def reference(
    logits: np.ndarray,
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    bad_words: tuple[tuple[int, ...], ...],
) -> np.ndarray:
    """[V] float64: vLLM's processing of one row of logits ([V]) after `prompt` and `output`;
    bans of bad words of several tokens yield where they would leave no allowed token
    (`processors.banned_now`)."""
    vocab = len(logits)
    bias = np.zeros(vocab)
    for token, value in (params.logit_bias or {}).items():
        bias[token] += value
    if params.allowed_token_ids is not None:
        outside = np.ones(vocab, bool)
        outside[list(params.allowed_token_ids)] = False
        bias[outside] = -np.inf
    single = {word[0] for word in bad_words if len(word) == 1}
    ends = {  # banned while the output ends with the word's other tokens
        word[-1]
        for word in bad_words
        if 1 < len(word) <= len(output) + 1
        and tuple(output[len(output) - len(word) + 1 :]) == word[:-1]
    }
    if (
        ends
        and params.allowed_token_ids is not None
        and ends | single >= {*params.allowed_token_ids}
    ):
        ends = set()
    bias[list(single | ends)] = -np.inf
    processed = logits.astype(np.float64) + bias
    seen = np.zeros(vocab, bool)
    seen[prompt] = True
    seen[output] = True
    penalty = params.repetition_penalty
    repeated = np.where(processed > 0, processed / penalty, processed * penalty)
    processed = np.where(seen, repeated, processed)
    counts = np.bincount(np.asarray(output, np.int64), minlength=vocab)
    processed -= params.frequency_penalty * counts
    processed -= params.presence_penalty * (counts > 0)
    return processed


def make_sequence(
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    vocab: int,
    bad_words: tuple[tuple[int, ...], ...] = (),
    slot: int = 0,
    stop_token_ids: frozenset[int] = frozenset(),
) -> Sequence:
    """A sequence holding slot `slot`, its prompt and output tokens on the host."""
    processors = SequenceProcessors(vocab, bad_words, slot=slot)
    seq = Sequence(
        0, np.asarray(prompt), params, max_tokens=len(output) + 16, processors=processors,
        stop_token_ids=stop_token_ids,
    )  # fmt: skip
    for token in output:
        seq.append_token(token)
    return seq


def write(state: ProcessorState, seq: Sequence) -> ProcessorState:
    rows = slot_write(seq, seq.num_output_tokens)
    return write_slot(state, jnp.int32(rows.slot), *map(jnp.asarray, rows[1:]))


@st.composite
def histories(draw, vocab: int) -> dict:
    """A slot's prompt, output, settings in vLLM's ranges and bad words (token ids)."""
    token = st.integers(0, vocab - 1)
    penalty = st.one_of(st.just(0.0), st.floats(-2.0, 2.0))
    allowed = st.one_of(st.none(), st.sets(token, min_size=1, max_size=vocab).map(sorted))
    params = SamplingParams(
        presence_penalty=draw(penalty),
        frequency_penalty=draw(penalty),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.1, 4.0))),
        logit_bias=draw(st.dictionaries(token, st.floats(-30.0, 30.0), max_size=4)) or None,
        allowed_token_ids=draw(allowed),
    )
    return dict(
        prompt=draw(st.lists(token, min_size=1, max_size=8)),
        output=draw(st.lists(token, max_size=10)),
        params=params,
        bad_words=tuple(
            draw(st.lists(st.lists(token, min_size=1, max_size=3).map(tuple), max_size=3))
        ),
    )


# Compiled once per vocabulary (the state holds 4 slots, a step 6 rows: one shape each).
PROCESS = jax.jit(process)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), vocab=st.sampled_from([5, 23, 64]), num_slots=st.integers(1, 4))
def test_process_equals_vllm_formulas(data, vocab, num_slots):
    slots = [data.draw(histories(vocab)) for _ in range(num_slots)]
    rows = data.draw(st.lists(st.integers(-1, num_slots - 1), min_size=6, max_size=6))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = rng.normal(0.0, 5.0, (len(rows), vocab)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.1] = 0.0  # neither positive nor negative
    state = ProcessorState.zeros(4, vocab)
    for slot, history in enumerate(slots):
        state = write(state, make_sequence(vocab=vocab, slot=slot, **history))

    processed = np.asarray(PROCESS(jnp.asarray(logits), state, jnp.asarray(rows, jnp.int32)))

    assert processed.dtype == np.float32
    for row, slot in enumerate(rows):
        if slot < 0:
            np.testing.assert_array_equal(processed[row], logits[row])
            continue
        expected = reference(logits[row], **slots[slot])
        if np.isneginf(expected).all():  # nothing left to sample: the logits it came with
            expected = logits[row]
        np.testing.assert_array_equal(np.isneginf(processed[row]), np.isneginf(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(processed[row][finite], expected[finite], rtol=1e-6, atol=1e-4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    output=st.lists(st.integers(0, 5), max_size=14),
    known=st.integers(0, 14),
    bad_words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple), max_size=4),
    slot=st.integers(0, 2),
    bias=st.dictionaries(st.integers(0, 5), st.floats(-5.0, 5.0), max_size=3),
    min_tokens=st.integers(0, 8),
    stops=st.frozensets(st.integers(0, 5), max_size=2),
)
def test_counts_and_ban_edits_step_by_step_equal_a_fresh_write(
    prompt, output, known, bad_words, slot, bias, min_tokens, stops
):
    """A slot written with the first `known` output tokens, then each later token counted on
    the device and the bans edited where they change (bad words, and the stop tokens before
    min_tokens), holds what a write of the whole output holds; the other slots stay zero."""
    vocab, bad_words = 6, tuple(bad_words)
    params = SamplingParams(
        presence_penalty=0.5, logit_bias=bias or None, min_tokens=min_tokens, max_tokens=16
    )
    known = min(known, len(output))
    seq = make_sequence(prompt, output[:known], params, vocab, bad_words, slot, stops)
    state = write(ProcessorState.zeros(3, vocab), seq)
    for token in output[known:]:
        rows = jnp.asarray([-1, slot, -1], jnp.int32)  # rows of no slot count nothing
        state = count_tokens(state, rows, jnp.asarray([4, token, 5], jnp.int32))
        seq.append_token(token)
        edits = ban_edits(seq, seq.num_output_tokens)
        if edits:
            slots, tokens, values = (np.asarray(column) for column in zip(*edits, strict=True))
            state = edit_bias(
                state,
                jnp.asarray(np.append(slots, -1), jnp.int32),  # a padding entry: slot -1
                jnp.asarray(np.append(tokens, 0), jnp.int32),
                jnp.asarray(np.append(values, 0.0), jnp.float32),
            )
        assert seq.processors.banned == banned_now(seq, seq.num_output_tokens)
        if seq.num_output_tokens < min_tokens:
            assert stops <= seq.processors.banned

    whole = make_sequence(prompt, output, params, vocab, bad_words, slot, stops)
    fresh = write(ProcessorState.zeros(3, vocab), whole)
    for name, array, expected in zip(state._fields, state, fresh, strict=True):
        np.testing.assert_array_equal(np.asarray(array), np.asarray(expected), err_msg=name)
    others = [s for s in range(3) if s != slot]
    assert not np.asarray(state.tokens)[others].any() and not np.asarray(state.bias)[others].any()


def test_count_tokens_counts_repeats_and_drops_rows_of_no_slot():
    tokens = np.zeros((3, 8), np.int32)
    tokens[0, 3] = IN_PROMPT
    state = ProcessorState.zeros(3, 8)._replace(tokens=jnp.asarray(tokens))
    rows = jnp.asarray([0, -1, 0, 2, -1], jnp.int32)

    counted = count_tokens(state, rows, jnp.asarray([3, 5, 3, 1, 7], jnp.int32))

    expected = tokens.copy()
    expected[0, 3] = IN_PROMPT + 2  # counted twice, still in the prompt
    expected[2, 1] = 1  # the last slot: what a -1 row would reach if it indexed from the end
    np.testing.assert_array_equal(np.asarray(counted.tokens), expected)


def test_edit_bias_sets_entries_and_ignores_slot_minus_one():
    bias = np.arange(24, dtype=np.float32).reshape(3, 8)
    state = ProcessorState.zeros(3, 8)._replace(bias=jnp.asarray(bias))

    edited = edit_bias(
        state,
        jnp.asarray([1, -1, 2, 0], jnp.int32),
        jnp.asarray([4, 6, 0, 7], jnp.int32),
        jnp.asarray([-np.inf, 99.0, 3.5, -1.0], jnp.float32),
    )

    expected = bias.copy()
    expected[1, 4], expected[2, 0], expected[0, 7] = -np.inf, 3.5, -1.0  # set, not added
    np.testing.assert_array_equal(np.asarray(edited.bias), expected)


def test_apply_writes_a_slot_then_edits_in_chunks():
    """More bias edits than one chunk of `EDIT_CHUNK` (padded with slot -1), after a slot write;
    the processed rows and the counts that follow."""
    vocab = 2 * EDIT_CHUNK
    processors = LogitsProcessors(
        num_slots=3,
        vocab_size=vocab,
        sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        on_devices=jnp.asarray,
        num_tokens=4,  # a step's sampled tokens: its rows, then padding
    )
    num_edits = EDIT_CHUNK + 6
    edit_tokens = np.arange(num_edits, dtype=np.int32)
    edit_slots = np.where(edit_tokens % 5 == 0, -1, 1).astype(np.int32)
    edit_values = np.linspace(-3.0, 3.0, num_edits).astype(np.float32)
    written = SlotWrite(
        slot=1,
        tokens=np.full(vocab, 2, np.int32),
        bias=np.full(vocab, 0.5, np.float32),
        penalties=np.array([0.0, 1.0, 1.0], np.float32),  # frequency 1: minus each count
    )
    plan = ProcessorPlan(
        rows=np.array([[-1, 1], [-1, 1]], np.int32),
        writes=[written],
        edits=(edit_slots, edit_tokens, edit_values),
    )
    logits = np.linspace(-4.0, 4.0, 2 * vocab).astype(np.float32).reshape(2, vocab)

    processed, rows = processors.apply(jnp.asarray(logits), plan)
    processors.count(rows, jnp.asarray([9, 7, 0, 0], jnp.int32))  # sampled rows and padding

    bias = np.full(vocab, 0.5, np.float32)
    bias[edit_tokens[edit_slots == 1]] = edit_values[edit_slots == 1]
    np.testing.assert_array_equal(np.asarray(processors.state.bias)[1], bias)
    assert not np.asarray(processors.state.bias)[[0, 2]].any()
    processed = np.asarray(processed)
    np.testing.assert_array_equal(processed[0], logits[0])
    np.testing.assert_allclose(processed[1], logits[1] + bias - 2.0, rtol=1e-6, atol=1e-6)
    counts = np.asarray(processors.state.tokens)
    assert counts[1, 7] == 3 and (np.delete(counts[1], 7) == 2).all()
    assert not counts[[0, 2]].any()  # the row of no slot counted nothing


BAD_WORDS = ((5,), (1, 2), (1, 2, 3), (2, 3), (4, 4))


def banned(output: list[int], bad_words=BAD_WORDS, **params) -> frozenset[int]:
    processors = SequenceProcessors(vocab_size=8, bad_words=bad_words)
    seq = Sequence(
        0,
        np.asarray([1, 2]),
        SamplingParams(**params),
        max_tokens=8,
        processors=processors,
        stop_token_ids=frozenset({7}),
    )
    for token in output:
        seq.append_token(token)
    return banned_now(seq, len(output))


def test_banned_now_names_last_tokens_whose_words_end_the_output():
    assert banned([]) == frozenset()  # one-token words are banned in the static bias
    assert banned([1]) == {2}  # (1, 2), and not (1, 2, 3): its (1, 2) is not there yet
    assert banned([7, 1]) == {2}
    assert banned([1, 2]) == {3}  # (1, 2, 3) and (2, 3)
    assert banned([2]) == {3}
    assert banned([4]) == {4}
    assert banned([4, 4, 1]) == {2}
    assert banned([2, 1, 3]) == frozenset()
    assert banned([1, 7]) == frozenset()
    # The prompt ([1, 2]) is not the output: nothing is banned before the first token.
    assert banned([], bad_words=((2, 3),)) == frozenset()


def test_bans_never_leave_none_of_the_allowed_tokens():
    """Words of several tokens are not banned where, with the one-token words and min_tokens'
    stop tokens, they would ban every allowed token; else they are."""
    words = ((1, 2), (1, 3), (5,))
    assert banned([1], words, allowed_token_ids=[2, 3, 4]) == {2, 3}
    assert banned([1], words, allowed_token_ids=[2, 3]) == frozenset()
    assert banned([1], words, allowed_token_ids=[2, 3, 5]) == frozenset()  # 5: a bad word
    assert banned([1], words, allowed_token_ids=[2, 3, 7], min_tokens=4) == {7}  # 7: a stop
    assert banned([1], words, allowed_token_ids=[2, 3, 7]) == {2, 3}


# The texts `TableTokenizer` encodes.
TOKEN_TABLE = {
    "hello": [1, 2],
    " hello": [3],  # a different length: not a variant
    "world": [4],
    " world": [5],  # the same length, another first token: a variant
    "same": [6, 7],
    " same": [6, 8],  # the same first token: not a variant
    "ab": [9, 10],
    " ab": [11, 12],
    "": [],
    " ": [13],
}


class TableTokenizer:
    """A tokenizer of a fixed table of texts (`encode` only)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return TOKEN_TABLE[text]


def test_bad_word_ids_adds_the_spaced_variant_as_vllm_does():
    tokenizer = TableTokenizer()
    assert bad_word_ids(tokenizer, ("hello",)) == ((1, 2),)
    assert bad_word_ids(tokenizer, ("world",)) == ((4,), (5,))
    assert bad_word_ids(tokenizer, ("same",)) == ((6, 7),)
    assert bad_word_ids(tokenizer, (" ab", "hello")) == ((9, 10), (11, 12), (1, 2))  # lstrip
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words: ' ' is no token"):
        bad_word_ids(tokenizer, ("hello", " "))  # nothing to ban: vLLM refuses it too


def test_a_banned_token_stays_banned_under_a_penalty_that_rounds_to_zero():
    """-inf times a repetition penalty of 1e-50 (0 in float32) would be NaN, which argmax picks."""
    tokens = np.full((1, 4), IN_PROMPT, np.int32)  # every token in the prompt
    bias = np.array([[0.0, -np.inf, 0.0, -np.inf]], np.float32)
    penalties = np.array([[0.0, 0.0, 1e-50]], np.float32)
    state = ProcessorState(jnp.asarray(tokens), jnp.asarray(bias), jnp.asarray(penalties))
    logits = jnp.asarray([[1.0, 5.0, -2.0, 9.0]], jnp.float32)

    processed = np.asarray(process(logits, state, jnp.asarray([0], jnp.int32)))

    assert np.isneginf(processed[0, [1, 3]]).all()
    assert not np.isnan(processed).any()
    assert int(np.argmax(processed)) in (0, 2)


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(1, 200), rows=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_bitmask_keeps_exactly_the_set_bits(vocab, rows, seed):
    """Token t of a row is kept where bit t % 32 of word t // 32 is set (llguidance's layout,
    sign bit included), else -inf."""
    rng = np.random.default_rng(seed)
    words = -(-vocab // 32)
    bitmask = rng.integers(-(2**31), 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    expected = np.where(bits == 1, logits, -np.inf)
    masked = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(masked, expected)
