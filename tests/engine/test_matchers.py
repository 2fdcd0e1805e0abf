"""The two grammar libraries behind structured outputs (`jaxllm.matchers`): which spec goes to
which, and that a request samples the same tokens under either."""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import jsonschema
import numpy as np
import pytest
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
