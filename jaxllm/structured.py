"""Structured outputs on the host: grammars compiled once per spec, a matcher per sequence, and
each step's token masks.

A request's `StructuredOutputsParams` is checked when it is submitted (`Grammars.compile`: an
invalid schema, regex or grammar is a ValueError then) and compiled in a background thread, once
per distinct spec; a sequence whose grammar is still compiling waits in the queue
(`SequenceGrammar.ready`). While the device runs a constrained step's forward pass, the engine
advances the grammars past the previous step's tokens and fills the rows' masks in parallel
(`Grammars.bitmask`), which the sampler applies (`model.logits_processors.apply_bitmask`). The
scheduler stops a sequence when its grammar admits nothing more.

Decode plans of several steps (`Scheduler._multi_step_counts`) run constrained rows where the
runner has a mailbox (`jaxllm.handoff`: one device): each step samples under its own mask,
filled from the tokens before it while the plan runs (`handoff.StepwiseMasks`). Elsewhere
(tensor parallelism) constrained rows take plans of one step.

The grammars come from llguidance, or from xgrammar where it takes the spec and is installed
(`jaxllm.matchers`); llguidance is an optional dependency (`pip install 'jaxllm[structured]'`),
xgrammar one more (`jaxllm[xgrammar]`), each imported on first use.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
from collections import OrderedDict

import numpy as np

from jaxllm.matchers import MASK_THREADS, LLGuidance, XGrammar, import_library, llguidance_grammar
from jaxllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The distinct specs whose compiled grammars are kept, the least recently used dropped first:
# llguidance's hold MASK_THREADS matchers (a schema of 20 keys ~0.25 MiB each, on a CPU).
COMPILED_GRAMMARS = 64
# The longest a step waits for a grammar's compile (nothing else to run): Ctrl-C, held back
# while a step runs, is taken between two steps.
COMPILE_WAIT_SECONDS = 0.1


class SequenceGrammar:
    """One sequence's matcher, made by its grammar's library once the grammar is compiled (of
    llguidance's compiled copies, the `family`th)."""

    __slots__ = ("_compiled", "_family", "library", "matcher")

    def __init__(self, compiled: concurrent.futures.Future, family: int):
        self._compiled = compiled
        self._family = family
        self.library = None  # `jaxllm.matchers.LLGuidance` or `XGrammar`, once `ready`
        self.matcher = None  # the library's matcher, once `ready`

    @property
    def ready(self) -> bool:
        """Whether the grammar is compiled (the sequence can be scheduled)."""
        if self.matcher is None and self._compiled.done():
            self.library, compiled = self._compiled.result()
            self.matcher = self.library.matcher(compiled, self._family)
        return self.matcher is not None

    @property
    def is_terminated(self) -> bool:
        """The grammar admits no more tokens (it consumed eos, nothing can follow, or it
        failed: `error`)."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token it refused, a grammar too complex for its lexer),
        or None: the first line of the library's error, which goes on with its state and the
        whole grammar."""
        if not self.matcher.is_error():
            return None
        return (self.matcher.get_error() or "no reason given").strip().partition("\n")[0]


def accept_tokens(plan, tokens: list[list[int]]) -> dict[int, int]:
    """Advances the matcher of each row of a one-step `StepPlan` that samples under a live
    grammar past the row's token, the rows in parallel; returns how many each such row keeps
    (1). A token the mask did not allow (it allowed none) leaves the matcher in an error state,
    which `is_terminated` reports."""
    rows = grammar_rows(plan)
    if rows and plan.bucket.num_steps > 1:  # NOTE: the mailbox's `StepwiseMasks` reads those
        raise ValueError("a plan of several steps with constrained rows has no mailbox")
    consume_tokens([(grammar, tokens[row][0]) for row, grammar in rows])
    return dict.fromkeys((row for row, _ in rows), 1)


def check(params: StructuredOutputsParams) -> None:
    """Checks `params`' schema, regex or grammar without a tokenizer (the command line, before
    an engine starts); `Grammars.compile` checks it again with the engine's.

    Raises:
        ValueError: an invalid schema, regex or grammar, naming the field and the reason.
        ImportError: llguidance is not installed, naming the extra that brings it.
    """
    llguidance_grammar(import_library("llguidance"), params, None)


def fill_masks(rows: list[tuple[int, SequenceGrammar]], mask: np.ndarray) -> None:
    """Fills row `row` of `mask` from each grammar's matcher, each library's rows in parallel."""
    for library, pairs in _by_library(rows).items():
        library.fill([grammar.matcher for _, grammar in pairs], [row for row, _ in pairs], mask)


def consume_tokens(pairs: list[tuple[SequenceGrammar, int]]) -> None:
    """Advances each grammar's matcher past its token, each library's in parallel."""
    for library, own in _by_library([(token, grammar) for grammar, token in pairs]).items():
        library.consume([grammar.matcher for _, grammar in own], [token for token, _ in own])


def _by_library(pairs: list[tuple[int, SequenceGrammar]]) -> dict:
    by_library: dict = {}
    for value, grammar in pairs:
        by_library.setdefault(grammar.library, []).append((value, grammar))
    return by_library


def grammar_rows(plan) -> list[tuple[int, SequenceGrammar]]:
    """(row, grammar) of each row of a `StepPlan` that samples under a live sequence's grammar."""
    rows = enumerate(zip(plan.seqs, plan.samples, strict=True))
    return [
        (row, seq.grammar)
        for row, (seq, samples) in rows
        if samples and seq.grammar and not seq.is_finished
    ]


class Grammars:
    """Compiles grammars and fills token masks for one engine (its libraries set up on first
    use: llguidance on the first spec, xgrammar on the first it takes).

    Args:
        tokenizer: the engine's Hugging Face fast tokenizer.
        vocab_size: the model's vocabulary (the masks' width, padded to 32 tokens a word).
        eos_token_ids: the tokens a finished grammar allows, the first its end of text.

    Mutates: `compile` caches the COMPILED_GRAMMARS distinct specs used last.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._llguidance: LLGuidance | None = None
        self._xgrammar: XGrammar | bool | None = None  # False: not installed or failed
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-grammar")
        self._compiled: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        # Each compiled grammar's next family: its sequences spread over all of them.
        self._families: dict[concurrent.futures.Future, itertools.cycle] = {}

    def _library(self) -> LLGuidance:
        """llguidance for the engine's tokenizer, set up on first use (ValueError: a tokenizer
        larger than the model's vocabulary; ImportError: llguidance is not installed)."""
        if self._llguidance is None:
            if len(self._tokenizer) > self.vocab_size:
                raise ValueError(
                    f"structured outputs need the model's vocabulary ({self.vocab_size}) to hold "
                    f"the tokenizer's ({len(self._tokenizer)} tokens)"
                )
            self._llguidance = LLGuidance(self._tokenizer, self.vocab_size, self._eos)
        return self._llguidance

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of `params` (a future of (library, compiled grammar): compiled
        in the background, once per distinct spec while it is among the COMPILED_GRAMMARS used
        last); the spec is checked first, by llguidance.

        Raises:
            ValueError: an invalid schema, regex or grammar, naming the field and the reason.
            ImportError: llguidance is not installed.
        """
        llguidance = self._library()
        key = (*params.spec, params.disable_any_whitespace)
        compiled = self._compiled.get(key)
        if compiled is None:
            grammar = llguidance.grammar(params)
            compiled = self._compiler.submit(self._build, params, grammar)
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_GRAMMARS:  # its sequences keep theirs
                self._families.pop(self._compiled.popitem(last=False)[1], None)
        self._compiled.move_to_end(key)
        return compiled

    def _build(self, params: StructuredOutputsParams, grammar: str) -> tuple:
        """(library, compiled grammar) of a checked spec: xgrammar's where it is installed and
        takes the spec, else llguidance's of `grammar`."""
        if not XGrammar.takes(params):
            return self._llguidance, self._llguidance.compile(grammar)
        if self._xgrammar is None:
            try:
                self._xgrammar = XGrammar(self._tokenizer, self.vocab_size, self._eos)
            except ImportError:
                self._xgrammar = False
            except Exception as error:  # NOTE: any, of a library llguidance stands in for
                logger.warning("JSON schemas go to llguidance: xgrammar failed: %s", error)
                self._xgrammar = False
        if self._xgrammar:
            try:
                return self._xgrammar, self._xgrammar.compile(params)
            except Exception as error:  # NOTE: a schema it cannot compile (RuntimeError), or any
                logger.warning("a JSON schema goes to llguidance: xgrammar failed: %s", error)
        return self._llguidance, self._llguidance.compile(grammar)

    def sequence_grammar(self, compiled: concurrent.futures.Future) -> SequenceGrammar:
        """A sequence's grammar, of `compile`'s result, in the next family."""
        families = self._families.setdefault(compiled, itertools.cycle(range(MASK_THREADS)))
        return SequenceGrammar(compiled, next(families))

    @staticmethod
    def wait(grammars: list[SequenceGrammar | None]) -> None:
        """Blocks until one of these sequences' grammars is compiled (none compiling: at once),
        or `COMPILE_WAIT_SECONDS` pass; for an engine with nothing else to run."""
        compiling = [g._compiled for g in grammars if g is not None and not g._compiled.done()]
        concurrent.futures.wait(
            compiling, COMPILE_WAIT_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED
        )

    def bitmask(self, plan) -> np.ndarray:
        """A `StepPlan`'s token bitmask, [S, ceil(V / 32)] int32: bit t % 32 of word t // 32 of
        a row set where the row's grammar allows token t, every bit set in free rows; its
        constrained rows (`grammar_rows`) filled in parallel."""
        rows, num_rows = grammar_rows(plan), plan.bucket.num_sampled
        words = -(-self.vocab_size // 32)
        mask = np.empty((num_rows, words), np.int32)  # NOTE: the libraries write whole rows
        free = np.ones(num_rows, bool)
        free[[row for row, _ in rows]] = False
        mask[free] = -1
        fill_masks(rows, mask)
        return mask
