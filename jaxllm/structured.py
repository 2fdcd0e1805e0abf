"""Structured outputs on the host: grammars compiled by llguidance, a matcher per sequence, and
each step's token masks.

A request's `StructuredOutputsParams` is checked when it is submitted (`Grammars.compile`: an
invalid schema, regex or grammar is a ValueError then), and compiled in a background thread,
once per distinct spec; a sequence whose grammar is still compiling waits in the queue while
the others run (`SequenceGrammar.ready`). The scheduler feeds each sampled token to its
sequence's matcher and stops the sequence when the grammar admits nothing more. For a step
with constrained rows, while the device runs the step's forward pass, the engine applies the
previous step's tokens (the grammars advance) and fills the rows' masks (`Grammars.bitmask`, in
parallel across rows); the device applies them to the logits
(`model.logits_processors.apply_bitmask`).

llguidance is an optional dependency (`pip install 'jaxllm[structured]'`), imported on first use.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import os

import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams

EXTRA_HINT = "structured outputs need llguidance: pip install 'jaxllm[structured]'"
# Threads filling masks and advancing matchers. llguidance serializes the work of matchers
# copied from one compiled matcher (they share its caches), so each grammar is compiled once per
# thread and sequences copy the copies in turn: on an H200 host, 256 rows of one JSON schema
# fill in 0.94 ms on 8 threads, 2.79 from one compiled matcher (docs/performance.md).
MASK_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


class SequenceGrammar:
    """One sequence's matcher: a copy of one of its grammar's compiled ones (`family`), taken
    once compiled."""

    __slots__ = ("_compiled", "_executor", "_family", "_matcher")

    def __init__(self, compiled: concurrent.futures.Future, family: int, executor) -> None:
        self._compiled = compiled
        self._family = family
        self._executor = executor
        self._matcher = None

    @property
    def ready(self) -> bool:
        """Whether the grammar is compiled (the sequence can be scheduled)."""
        if self._matcher is None and self._compiled.done():
            self._matcher = self._compiled.result()[self._family].deep_copy()
        return self._matcher is not None

    @property
    def matcher(self):
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        """The grammar admits no more tokens (it consumed eos, or nothing can follow)."""
        return self._matcher.is_stopped() or self._matcher.is_error()


def accept_tokens(plan, tokens: list[list[int]]) -> None:
    """Advances the matcher of each row of a `StepPlan` that samples under a live grammar past
    the row's token (`tokens[row][0]`: such plans run one step), in parallel. A token the mask
    did not allow leaves the matcher in an error state, which `is_terminated` reports."""
    rows = grammar_rows(plan)
    if rows:
        sampled = [(grammar.matcher, tokens[row][0]) for row, grammar in rows]
        rows[0][1]._executor.consume_token_par(sampled)


def grammar_rows(plan) -> list[tuple[int, SequenceGrammar]]:
    """(row, grammar) of each row of a `StepPlan` that samples under a live sequence's grammar."""
    rows = enumerate(zip(plan.seqs, plan.samples, strict=True))
    return [
        (row, seq.grammar)
        for row, (seq, samples) in rows
        if samples and seq.grammar and not seq.is_finished
    ]


class Grammars:
    """Compiles grammars and fills token masks for one engine (llguidance, set up on first use).

    Args:
        tokenizer: the engine's Hugging Face fast tokenizer.
        vocab_size: the model's vocabulary (the masks' width, padded to 32 tokens a word).
        eos_token_ids: the tokens a finished grammar allows, the first its end of text.

    Mutates: `compile` caches each distinct spec's compiled grammar.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._llguidance = None
        self._lltokenizer = None
        self._executor = None  # fills masks and advances matchers on MASK_THREADS threads
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-grammar")
        self._compiled: dict[tuple[str, str, bool], concurrent.futures.Future] = {}
        # Each compiled grammar's next family: its sequences spread over all of them.
        self._families: dict[concurrent.futures.Future, itertools.cycle] = {}

    def _library(self):
        """llguidance, with the engine's tokenizer and mask executor built on first use.

        Raises:
            ImportError: llguidance is not installed, naming the extra that brings it.
        """
        if self._llguidance is None:
            try:
                llguidance = importlib.import_module("llguidance")
                hf = importlib.import_module("llguidance.hf")
            except ImportError as error:
                raise ImportError(EXTRA_HINT) from error
            if len(self._tokenizer) > self.vocab_size:
                raise ValueError(
                    f"structured outputs need the model's vocabulary ({self.vocab_size}) to hold "
                    f"the tokenizer's ({len(self._tokenizer)} tokens)"
                )
            self._lltokenizer = hf.from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
            )
            self._executor = llguidance.LLExecutor(MASK_THREADS)
            self._llguidance = llguidance
        return self._llguidance

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of `params` (a future of its MASK_THREADS compiled matchers:
        compiled in the background, once per distinct spec); the spec is checked first.

        Raises:
            ValueError: an invalid schema, regex or grammar, naming the field and the reason.
            ImportError: llguidance is not installed.
        """
        llguidance = self._library()
        kind, text = params.spec
        key = (kind, text, params.disable_any_whitespace)
        compiled = self._compiled.get(key)
        if compiled is None:
            field = "json_object" if params.json_object else kind
            try:
                if kind == "json":
                    options = {"whitespace_flexible": not params.disable_any_whitespace}
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(text, options)
                else:
                    grammar = llguidance.grammar_from(kind, text)
                error = llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer)
            except ValueError as raised:
                error = str(raised)
            if error:
                raise ValueError(f"StructuredOutputsParams.{field} is invalid: {error.strip()}")
            compiled = self._compiler.submit(self._matchers, grammar)
            self._compiled[key] = compiled
        return compiled

    def _matchers(self, grammar: str) -> list:
        llguidance = self._llguidance
        return [
            llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)
            for _ in range(MASK_THREADS)
        ]

    def sequence_grammar(self, compiled: concurrent.futures.Future) -> SequenceGrammar:
        """A sequence's grammar, of `compile`'s result, in the next family."""
        families = self._families.setdefault(compiled, itertools.cycle(range(MASK_THREADS)))
        return SequenceGrammar(compiled, next(families), self._executor)

    @staticmethod
    def wait(grammars: list[SequenceGrammar | None]) -> None:
        """Blocks until one of these sequences' grammars is compiled (none compiling: at once);
        for an engine with nothing else to run."""
        compiling = [g._compiled for g in grammars if g is not None and not g._compiled.done()]
        concurrent.futures.wait(compiling, return_when=concurrent.futures.FIRST_COMPLETED)

    def bitmask(self, rows: list[tuple[int, SequenceGrammar]], num_rows: int) -> np.ndarray:
        """[num_rows, ceil(V / 32)] int32: bit t % 32 of word t // 32 of a row set where the
        row's grammar allows token t; every bit set in the rows not in `rows` ((row, grammar)
        pairs), which are filled in parallel."""
        words = -(-self.vocab_size // 32)
        mask = np.empty((num_rows, words), np.int32)  # NOTE: llguidance writes whole rows
        free = np.ones(num_rows, bool)
        free[[row for row, _ in rows]] = False
        mask[free] = -1
        if rows:
            llguidance_numpy = importlib.import_module("llguidance.numpy")
            matchers = [(grammar.matcher, row) for row, grammar in rows]
            llguidance_numpy.fill_next_token_bitmask_par(self._executor, matchers, mask)
        return mask
