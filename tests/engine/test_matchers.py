"""The two grammar libraries behind structured outputs (`jaxllm.matchers`): which spec goes to
which, and that a request samples the same tokens under either."""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine import assert_idle

from jaxllm import SamplingParams, StructuredOutputsParams
from jaxllm.matchers import LLGuidance, XGrammar

pytest.importorskip("llguidance")
pytest.importorskip("xgrammar")

SCHEMA = {
    "$defs": {"tag": {"type": "string", "maxLength": 3}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "score": {"type": "number", "minimum": -2.5, "maximum": 7},
        "kind": {"anyOf": [{"const": "x"}, {"type": "integer", "exclusiveMinimum": 3}]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
        "pair": {
            "type": "array",
            "prefixItems": [{"type": "boolean"}, {"enum": [1, "b"]}],
            "items": False,
        },
    },
    "required": ["name", "score", "kind", "tags", "pair"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "schema, takes",
    [
        (SCHEMA, True),
        ({"type": "object"}, True),
        ({"type": "string", "pattern": "^a+$"}, False),
        ({"type": "string", "format": "email"}, False),
        ({"not": {"type": "string"}}, False),
        ({"type": "array", "items": {"type": "integer", "multipleOf": 3}}, False),
        ({"properties": {"a": {"oneOf": [{"type": "integer"}]}}}, False),
        ({"$defs": {"a": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/a"}, False),
        # xgrammar compiles these but lets through what they forbid
        ({"type": "object", "properties": {"a": {}}, "required": ["a", "x"]}, False),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "integer"}, False),
        ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, False),
        ({"enum": ["a", "abc"], "minLength": 2}, False),
        ({"minimum": 5}, False),
        ({"properties": {"a": {"type": "integer"}}}, False),
        ({"$defs": {"a": {"$id": "urn:a"}}, "type": "array", "items": {"$ref": "urn:a"}}, False),
        ({"anyOf": [{"const": "x"}, {"enum": [1, 2], "title": "t"}, {"$ref": "#"}]}, True),
        ({"type": ["integer", "null"], "description": "d"}, True),
        ({"type": ["integer", {"type": "string"}]}, False),  # malformed: no error
        ({"type": "object", "properties": {"a": {}}, "required": [["a"]]}, False),
        ({"type": "object", "properties": {"a": {}}, "required": "a"}, False),
    ],
)
def test_xgrammar_takes_schemas_of_the_keywords_it_enforces(schema, takes):
    """A keyword xgrammar compiles without enforcing it (or any it does not know), however
    deep, sends the schema to llguidance."""
    assert XGrammar.takes(StructuredOutputsParams(json=schema)) is takes
    assert not XGrammar.takes(StructuredOutputsParams(regex="[a-z]+"))
    assert XGrammar.takes(StructuredOutputsParams(json_object=True))


def libraries(llm, constraint) -> set[type]:
    """The libraries of the sequences' grammars a run of `constraint` used."""
    used = set()
    grammars = llm.engine.grammars
    original = grammars.sequence_grammar

    def recording(compiled):
        used.add(type(compiled.result()[0]))
        return original(compiled)

    grammars.sequence_grammar = recording
    try:
        params = SamplingParams(max_tokens=4, structured_outputs=constraint)
        llm.generate("x", params, use_tqdm=False)
    finally:
        del grammars.sequence_grammar
    return used


def sample(llm, constraint, seeds=range(12), max_tokens=64):
    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, structured_outputs=c)
        for seed in seeds
        for c in [constraint]
    ]
    outputs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


@pytest.mark.parametrize("library", [XGrammar, LLGuidance])
def test_json_outputs_validate_and_stop_alike_under_either_library(text_llm, monkeypatch, library):
    """Every output is JSON of the schema, and it stops once nothing but eos can follow
    (without sampling eos) under either library."""
    if library is LLGuidance:
        monkeypatch.setattr(XGrammar, "takes", staticmethod(lambda params: False))
        monkeypatch.setattr(text_llm.engine.grammars, "_compiled", OrderedDict())
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert libraries(text_llm, constraint) == {library}
    completions = sample(text_llm, constraint)
    eos = text_llm.engine.grammars._eos
    for completion in completions:
        assert completion.finish_reason == "stop" and completion.token_ids[-1] not in eos
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len({c.text for c in completions}) > 6  # sampled, not forced
    assert_idle(text_llm)


def test_xgrammar_follows_json_schema_defaults_any_further_properties_and_items(text_llm):
    """Unlisted properties and items are allowed, as JSON Schema says (xgrammar's strict mode
    would allow none: `json_object` could only give `{}`)."""
    constraint = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    assert libraries(text_llm, constraint) == {XGrammar}
    objects = sample(text_llm, constraint, max_tokens=16)
    assert any(c.text.startswith('{"') for c in objects)
    schema = {"type": "array", "prefixItems": [{"type": "boolean"}], "minItems": 2}
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert libraries(text_llm, constraint) == {XGrammar}
    for completion in sample(text_llm, constraint, seeds=range(4)):
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
        assert completion.text.startswith(("[true,", "[false,"))


def test_xgrammar_strings_of_bounded_length_hold_no_raw_control_characters(text_llm):
    grammars = text_llm.engine.grammars
    constraint = StructuredOutputsParams(json={"type": "string", "maxLength": 5})
    grammar = grammars.sequence_grammar(grammars.compile(constraint))
    grammars.wait([grammar])
    assert grammar.ready and isinstance(grammar.library, XGrammar)
    grammar.library.consume([grammar.matcher], text_llm.tokenizer.encode('"'))
    mask = np.zeros((1, -(-grammars.vocab_size // 32)), np.int32)
    grammar.library.fill([grammar.matcher], [0], mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    texts = [text_llm.tokenizer.decode([token]) for token in np.flatnonzero(bits)]
    assert "ab" in texts and '"' in texts
    assert not [text for text in texts if any(ord(char) < 0x20 for char in text)]
    added = text_llm.tokenizer.added_tokens_decoder  # <|im_start|>, <think>: never text here
    assert not set(added) & set(np.flatnonzero(bits).tolist())


def test_xgrammar_keeps_no_cache_of_its_own(text_llm):
    """`Grammars` keeps the compiled grammars used last (COMPILED_GRAMMARS); xgrammar's own
    cache would keep every one."""
    grammars = text_llm.engine.grammars
    for length in range(3):
        constraint = StructuredOutputsParams(json={"type": "string", "maxLength": 10 + length})
        grammar = grammars.sequence_grammar(grammars.compile(constraint))
        while not grammar.ready:
            grammars.wait([grammar])
        assert isinstance(grammar.library, XGrammar)
    assert grammars._xgrammar._compiler.get_cache_size_bytes() == 0


def test_a_schema_xgrammar_would_not_enforce_is_enforced_by_llguidance(text_llm):
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-C]{2}[0-9]$"}},
        "required": ["code"],
        "additionalProperties": False,
    }
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert libraries(text_llm, constraint) == {LLGuidance}
    for completion in sample(text_llm, constraint, seeds=range(6)):
        assert completion.finish_reason == "stop"
        assert re.fullmatch(r"[A-C]{2}[0-9]", json.loads(completion.text)["code"])


def test_a_schema_xgrammar_cannot_compile_goes_to_llguidance(text_llm, monkeypatch):
    def refuse(self, params):
        raise RuntimeError("unsupported")

    monkeypatch.setattr(XGrammar, "compile", refuse)
    constraint = StructuredOutputsParams(json={"type": "array", "maxItems": 2})
    assert libraries(text_llm, constraint) == {LLGuidance}


def test_json_schemas_go_to_llguidance_when_xgrammar_cannot_read_the_tokenizer(
    text_llm, monkeypatch, caplog
):
    def unreadable(*args):
        raise RuntimeError("unreadable tokenizer")

    monkeypatch.setattr(text_llm.engine.grammars, "_xgrammar", None)
    monkeypatch.setattr(XGrammar, "__init__", unreadable)
    constraint = StructuredOutputsParams(json={"type": "array", "maxItems": 3})
    assert libraries(text_llm, constraint) == {LLGuidance}
    assert "xgrammar failed: unreadable tokenizer" in caplog.text


def test_an_xgrammar_matcher_given_a_token_it_does_not_allow_is_in_error(text_llm):
    grammars = text_llm.engine.grammars
    compiled = grammars.compile(StructuredOutputsParams(json={"type": "boolean"}))
    grammar = grammars.sequence_grammar(compiled)
    grammars.wait([grammar])
    assert grammar.ready and isinstance(grammar.library, XGrammar)
    [true], [five] = (text_llm.tokenizer.encode(text) for text in ("true", "5"))
    grammar.library.consume([grammar.matcher], [five])
    assert grammar.is_terminated and "not allowed" in grammar.error
    other = grammars.sequence_grammar(compiled)
    assert other.ready and not other.is_terminated
    mask = np.zeros((1, -(-grammars.vocab_size // 32)), np.int32)
    other.library.fill([other.matcher], [0], mask)
    assert mask[0, true // 32] >> (true % 32) & 1 and not mask[0, five // 32] >> (five % 32) & 1
    other.library.consume([other.matcher], [true])
    assert other.is_terminated and other.error is None  # nothing but eos can follow


def bounded(kind: str, low: str, high: str, start, width) -> st.SearchStrategy:
    """A schema of `kind` with or without each of two bounds (a range never empty)."""
    return st.builds(
        lambda first, span, keep: {
            "type": kind,
            **{key: value for key, value in ((low, first), (high, first + span)) if key in keep},
        },
        start,
        width,
        st.sets(st.sampled_from([low, high])),
    )


VALUES = [1, 'b"c', None, 2.5, [1]]
LEAVES = st.one_of(
    bounded("integer", "minimum", "exclusiveMaximum", st.integers(-20, 20), st.integers(1, 30)),
    bounded("number", "exclusiveMinimum", "maximum", st.integers(-5, 5), st.sampled_from([0.5, 3])),
    bounded("string", "minLength", "maxLength", st.integers(0, 4), st.integers(0, 6)),
    st.sampled_from([{"type": "boolean"}, {"type": ["null", "integer"]}, {"const": {"a": [1]}}]),
    st.sets(st.integers(0, len(VALUES) - 1), min_size=1, max_size=3).map(
        lambda picked: {"enum": [VALUES[index] for index in sorted(picked)]}
    ),
)


def nested(children: st.SearchStrategy) -> st.SearchStrategy:
    keys = st.sampled_from(["a", "b", "c"])
    objects = st.builds(
        lambda properties, required, further: {
            "type": "object",
            "properties": properties,
            "required": sorted(set(required) & set(properties)),
            "additionalProperties": further,
        },
        st.dictionaries(keys, children, max_size=3),
        st.lists(keys, max_size=3),
        st.one_of(st.booleans(), children),
    )
    arrays = st.builds(
        lambda items, most: {"type": "array", "items": items, "maxItems": most},
        children,
        st.integers(0, 3),
    )
    return st.one_of(
        objects,
        arrays,
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=st.recursive(LEAVES, nested, max_leaves=6), draws=st.randoms(use_true_random=False))
def test_a_walk_through_xgrammars_masks_ends_in_json_of_the_schema(text_llm, schema, draws):
    """Any schema `XGrammar.takes`: tokens drawn at random from xgrammar's masks, eos
    where it is allowed a third of the time, give JSON that validates."""
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert XGrammar.takes(params)
    grammars = text_llm.engine.grammars
    grammar = grammars.sequence_grammar(grammars.compile(params))
    grammars.wait([grammar])
    while not grammar.ready:
        grammars.wait([grammar])
    assert isinstance(grammar.library, XGrammar)
    eos, tokens = grammars._eos, []
    mask = np.zeros((1, -(-grammars.vocab_size // 32)), np.int32)
    while not grammar.is_terminated and len(tokens) < 60:
        grammar.library.fill([grammar.matcher], [0], mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        is_eos = np.isin(allowed, eos)
        ending, others = allowed[is_eos], allowed[~is_eos]
        ends = ending.size > 0 and (others.size == 0 or draws.random() < 1 / 3)
        token = int(ending[0] if ends else others[draws.randrange(len(others))])
        grammar.library.consume([grammar.matcher], [token])
        tokens += [token] if token not in eos else []
    assert grammar.error is None
    if grammar.is_terminated:
        jsonschema.validate(json.loads(text_llm.tokenizer.decode(tokens)), schema)


BOUNDED_STRINGS = {"type": "array", "items": {"type": "string", "maxLength": 4}}


@pytest.mark.parametrize(
    "constraint, prefixes",
    [
        (StructuredOutputsParams(json=BOUNDED_STRINGS), ['["ab', "[", ""]),
        (StructuredOutputsParams(regex="[a-z]{1,3}(-[0-9]+)?"), ["ab-", "a", ""]),
    ],
)
def test_masks_filled_on_the_caller_equal_the_pools(text_llm, monkeypatch, constraint, prefixes):
    grammars = text_llm.engine.grammars
    compiled = grammars.compile(constraint)
    sequences = [grammars.sequence_grammar(compiled) for _ in prefixes]
    while not all(grammar.ready for grammar in sequences):
        grammars.wait(sequences)
    library = sequences[0].library
    for grammar, prefix in zip(sequences, prefixes, strict=True):
        for token in text_llm.tokenizer.encode(prefix):
            library.consume([grammar.matcher], [token])
        assert not grammar.is_terminated
    masks = []
    for serial_rows in (0, 100):
        monkeypatch.setattr("jaxllm.matchers.SERIAL_MASK_ROWS", serial_rows)
        mask = np.zeros((4, -(-grammars.vocab_size // 32)), np.int32)
        library.fill([grammar.matcher for grammar in sequences], [3, 0, 2], mask)
        masks.append(mask)
    assert (masks[0] == masks[1]).all() and not masks[0][1].any()
    assert len({row.tobytes() for row in masks[0][[0, 2, 3]]}) == 3  # three states


def test_compact_json_masks_refuse_a_line_break_after_a_key(text_llm):
    """Compact JSON of an object that takes further properties: after `{"a":1,` the token
    `""\n` (an empty key, a line break) is refused by the mask, as by the matcher
    (xgrammar's own masks allow it, `STRING_LOOKAHEAD`)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    grammars, tokenizer = text_llm.engine.grammars, text_llm.tokenizer
    grammar = grammars.sequence_grammar(grammars.compile(params))
    while not grammar.ready:
        grammars.wait([grammar])
    assert isinstance(grammar.library, XGrammar)
    for token in tokenizer.encode('{"a":1,'):
        grammar.library.consume([grammar.matcher], [token])
    (line_break,) = tokenizer.encode('""\n')
    mask = np.zeros((1, -(-grammars.vocab_size // 32)), np.int32)
    grammar.library.fill([grammar.matcher], [0], mask)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert not allowed[line_break] and allowed[tokenizer.encode('"')[0]]
    grammar.library.consume([grammar.matcher], [line_break])
    assert grammar.error is not None
