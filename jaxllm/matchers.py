"""The grammar libraries behind structured outputs, behind one interface: llguidance, which
takes every kind of constraint, and xgrammar, which takes the JSON schemas it enforces
(`XGrammar.takes`) when it is installed. Their outputs differ only where the schema leaves a
choice: llguidance writes the text it forces as the tokenizer would, xgrammar lets the model
pick any tokens of it; a string of bounded length holds escapes under llguidance only.

A library checks a spec (llguidance's `grammar`: the error names the field), compiles it
(`compile`, on the compile thread), makes a sequence's matcher of the compiled grammar
(`matcher`), fills rows of a token bitmask for several matchers in parallel (`fill`) and
advances matchers past a token each (`consume`). A matcher answers as llguidance's does:
`is_stopped` (nothing but eos can follow, or eos was read), `is_error` and `get_error` (it was
given a token it did not allow).

Why two: llguidance walks the vocabulary's trie for every row, and inside a JSON string of a
`maxLength` below 10 it walks all of it (its slices of string tokens skip the walk only for
bounds of 10 and more); xgrammar keeps each grammar state's mask precomputed. The bench's
schema, 256 rows: 66.8 ms a step from llguidance on 8 threads, 2.3 from xgrammar, on an H100's
host (docs/performance.md). xgrammar depends on torch, so it is an extra of its own.
"""

from __future__ import annotations

import importlib
import json
import os

import numpy as np

EXTRA_HINT = "structured outputs need llguidance: pip install 'jaxllm[structured]'"
# Threads filling masks and advancing matchers. llguidance serializes the work of matchers
# copied from one compiled matcher (they share its caches), so each grammar is compiled once per
# thread and sequences copy the copies in turn: on an H200 host, 256 rows of one JSON schema
# fill in 0.94 ms on 8 threads, 2.79 from one compiled matcher (docs/performance.md).
MASK_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
# Fewer rows than this fill their masks on the calling thread: waking the pool costs more than
# they do (one row of the bench's schema from xgrammar, p50: 4 us on the caller, 71 us through
# the pool of 2 threads on a 2-core CPU).
SERIAL_MASK_ROWS = 16
# A character of a JSON string of bounded length in xgrammar's EBNF (`XGrammar.compile`): no
# escape, as xgrammar's own (with one, 32 rows of the bench's schema filled in 116 vs 0.68 ms).
BOUNDED_CHARACTER = r"[^\0-\x1f\"\\]"
# What may follow a string's closing quote, in xgrammar's EBNF: its masks read this lookahead,
# whose whitespace a compact grammar (`XGrammar.compile`) allows nowhere else, so they let
# through tokens such as `""` + a line feed that its matcher then refuses.
STRING_LOOKAHEAD = r"(=([ \n\r\t]* [,}\]:]))"
# The JSON Schemas xgrammar enforces as JSON Schema means them (it compiles more, such as
# `pattern`, `format`, `not`, keywords beside `anyOf` or `$ref`, `required` of a property it
# does not list, without enforcing them): a schema of anything else goes to llguidance. A part
# of a schema is a combinator alone, or a type with its keywords, besides annotations.
ANNOTATIONS = frozenset({"$schema", "$comment", "title", "description", "default", "examples"})
COMBINATORS = frozenset({"anyOf", "$ref", "enum", "const"})
_NUMBERS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
TYPE_KEYWORDS = {
    "string": frozenset({"minLength", "maxLength"}),
    "integer": _NUMBERS,
    "number": _NUMBERS,
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "boolean": frozenset(),
    "null": frozenset(),
}
_DEFINITIONS = ("$defs", "definitions")  # at any level, schemas `$ref` points to


def import_library(module: str):
    """An llguidance module; ImportError naming the extra that brings it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(EXTRA_HINT) from error


def llguidance_grammar(llguidance, params, lltokenizer) -> str:
    """`params`' llguidance grammar, validated against `lltokenizer` (None: any).

    Raises:
        ValueError: an invalid schema, regex or grammar, naming the field and the reason.
    """
    kind, text = params.spec
    try:
        if kind == "json":
            options = {"whitespace_flexible": not params.disable_any_whitespace}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, options)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_lark(choice_lark(json.loads(text)))
        else:
            grammar = llguidance.grammar_from(kind, text)
        error = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
    except ValueError as raised:
        error = str(raised)
    if error:
        field = "json_object" if params.json_object else kind
        raise ValueError(f"StructuredOutputsParams.{field} is invalid: {error.strip()}")
    return grammar


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar of one of `choices`: one terminal, which llguidance's lexer matches.
    NOTE: not a rule of one alternative each (llguidance's `grammar_from("choice")`), whose
    parser refuses, while it runs, a row of more than 2,000 items."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(choice) for choice in choices)


class LLGuidance:
    """llguidance for one engine's tokenizer: each grammar compiled MASK_THREADS times, its
    sequences' matchers copies of the copies in turn (`family`).

    Raises:
        ImportError: llguidance is not installed, naming the extra that brings it.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._llguidance = import_library("llguidance")
        self._numpy = import_library("llguidance.numpy")
        self.tokenizer = import_library("llguidance.hf").from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids
        )
        self._executor = self._llguidance.LLExecutor(MASK_THREADS)

    def grammar(self, params) -> str:
        """`params`' grammar, checked (ValueError naming the field and the reason)."""
        return llguidance_grammar(self._llguidance, params, self.tokenizer)

    def compile(self, grammar: str) -> list:
        matcher = self._llguidance.LLMatcher
        return [matcher(self.tokenizer, grammar, log_level=0) for _ in range(MASK_THREADS)]

    def matcher(self, compiled: list, family: int):
        return compiled[family % len(compiled)].deep_copy()

    def fill(self, matchers: list, rows: list[int], mask: np.ndarray) -> None:
        pairs = list(zip(matchers, rows, strict=True))
        if len(pairs) < SERIAL_MASK_ROWS:
            for matcher, row in pairs:
                self._numpy.fill_next_token_bitmask(matcher, mask, row)
        else:
            self._numpy.fill_next_token_bitmask_par(self._executor, pairs, mask)

    def consume(self, matchers: list, tokens: list[int]) -> None:
        self._executor.consume_token_par(list(zip(matchers, tokens, strict=True)))


class XGrammar:
    """xgrammar for one engine's tokenizer (set up on the compile thread, where it is first
    needed).

    Raises:
        ImportError: xgrammar is not installed.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        xgrammar = importlib.import_module("xgrammar")
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
        )
        # NOTE: `Grammars` keeps the compiled grammars used last; xgrammar's cache would grow
        self._compiler = xgrammar.GrammarCompiler(
            info, max_threads=MASK_THREADS, cache_enabled=False
        )
        self._batch = xgrammar.BatchGrammarMatcher(MASK_THREADS)
        self._xgrammar = xgrammar
        # xgrammar reads the tokenizer's added tokens (<|im_start|>, <think>) as text, which
        # llguidance allows only where a grammar spells them: `fill` clears them (but eos), in
        # the words that hold them.
        words = -(-vocab_size // 32)
        added = sorted(set(tokenizer.added_tokens_decoder) - set(eos_token_ids))
        self._added_words = np.unique(np.asarray(added, np.int64) // 32)
        self._keep = ~token_bits(added, words)[self._added_words]
        self.eos_mask = token_bits(eos_token_ids, words)

    @staticmethod
    def takes(params) -> bool:
        """Whether `params` is a JSON schema xgrammar enforces (ANNOTATIONS says which)."""
        kind, text = params.spec
        try:
            return kind == "json" and _enforced(json.loads(text))
        except TypeError:  # a part of the wrong type (unhashable), which llguidance refuses
            return False

    def compile(self, params):
        """`params`' compiled grammar (RuntimeError: a schema xgrammar cannot compile).

        xgrammar's strings of bounded length take any character but a quote, a backslash, CR
        and LF, raw control characters among them (JSON escapes them): they take
        `BOUNDED_CHARACTER`. A compact grammar's strings are followed by no whitespace
        (`STRING_LOOKAHEAD`)."""
        compact = params.disable_any_whitespace
        grammar = self._xgrammar.Grammar.from_json_schema(
            params.spec[1],
            any_whitespace=not compact,
            separators=(",", ":") if compact else None,
            strict_mode=False,  # JSON Schema's defaults: any further properties and items
        )
        ebnf = str(grammar).replace(r"[^\"\\\r\n]", BOUNDED_CHARACTER)
        if compact:
            ebnf = ebnf.replace(STRING_LOOKAHEAD, r"(=([,}\]:]))")
        return self._compiler.compile_grammar(ebnf)

    def matcher(self, compiled, family: int) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgrammar.GrammarMatcher(compiled), self)

    def fill(self, matchers: list[XGrammarMatcher], rows: list[int], mask: np.ndarray) -> None:
        if len(matchers) < SERIAL_MASK_ROWS:
            for matcher, row in zip(matchers, rows, strict=True):
                matcher.matcher.fill_next_token_bitmask(mask, row)
        else:
            own = [matcher.matcher for matcher in matchers]
            self._batch.batch_fill_next_token_bitmask(own, mask, list(rows))
        mask[np.ix_(rows, self._added_words)] &= self._keep

    def consume(self, matchers: list[XGrammarMatcher], tokens: list[int]) -> None:
        own = [matcher.matcher for matcher in matchers]
        accepted = self._xgrammar.BatchGrammarMatcher.batch_accept_token(own, tokens)
        for matcher, token, ok in zip(matchers, tokens, accepted, strict=True):
            matcher.read(token, ok)


class XGrammarMatcher:
    """An xgrammar matcher that answers as llguidance's: stopped once nothing but eos can follow
    (a sequence ends there under either library, without sampling eos), in error after a token
    it did not allow (xgrammar leaves its state as it was)."""

    __slots__ = ("_error", "_library", "_stopped", "matcher")

    def __init__(self, matcher, library: XGrammar) -> None:
        self.matcher = matcher
        self._library = library
        self._error: str | None = None
        self._stopped: bool | None = None  # known since the last token

    def read(self, token: int, accepted: bool) -> None:
        if not accepted and self._error is None:
            self._error = f"token {token} is not allowed"
        self._stopped = None

    def is_error(self) -> bool:
        return self._error is not None

    def get_error(self) -> str | None:
        return self._error

    def is_stopped(self) -> bool:
        if self._stopped is None:
            self._stopped = self.matcher.is_terminated() or (
                self.matcher.is_completed() and self._only_eos()
            )
        return self._stopped

    def _only_eos(self) -> bool:
        mask = np.zeros((1, self._library.eos_mask.size), np.int32)
        self._library.fill([self], [0], mask)
        return not (mask[0] & ~self._library.eos_mask).any()


def token_bits(tokens, words: int) -> np.ndarray:
    """[words] int32, bit t % 32 of word t // 32 set for each of `tokens`."""
    tokens = np.asarray(tokens, np.int64)
    bits = np.zeros(words, np.uint32)
    np.bitwise_or.at(bits, tokens // 32, (1 << (tokens % 32)).astype(np.uint32))
    return bits.view(np.int32)


def _enforced(schema) -> bool:
    """Whether xgrammar enforces a JSON schema (or a part of one): see ANNOTATIONS."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict):
        return False
    definitions = [schema[key] for key in _DEFINITIONS if key in schema]
    if not all(isinstance(d, dict) and all(map(_enforced, d.values())) for d in definitions):
        return False
    keywords = set(schema) - ANNOTATIONS - set(_DEFINITIONS)
    if keywords & COMBINATORS:
        (combinator,) = keywords if len(keywords) == 1 else (None,)
        if combinator == "anyOf":
            options = schema["anyOf"]
            return isinstance(options, list) and all(map(_enforced, options))
        return combinator in ("enum", "const") or (
            combinator == "$ref" and str(schema["$ref"]).startswith("#")
        )
    kind = schema.get("type")
    if not keywords - {"type"}:
        kinds = kind if isinstance(kind, list) else [kind]
        return kind is None or all(k in TYPE_KEYWORDS for k in kinds)
    if not isinstance(kind, str) or not keywords - {"type"} <= TYPE_KEYWORDS.get(kind, set()):
        return False
    parts = [schema.get("items", True), schema.get("additionalProperties", True)]
    parts += schema.get("prefixItems", [])
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        return False
    return set(required) <= set(properties) and all(map(_enforced, [*parts, *properties.values()]))
