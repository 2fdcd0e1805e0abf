"""Structured outputs on the host: grammars compiled once per spec, a matcher per sequence, and
each step's token masks.

A request's `StructuredOutputsParams` is checked when it is submitted (`Grammars.compile`: an
invalid schema, regex or grammar is a ValueError then) and compiled in a background thread, once
per distinct spec; a sequence whose grammar is still compiling waits in the queue
(`SequenceGrammar.ready`). While the device runs a constrained step's forward pass, the engine
advances the grammars past the previous step's tokens and fills the rows' masks in parallel
(`Grammars.bitmask`), which the sampler applies (`model.logits_processors.apply_bitmask`). The
scheduler stops a sequence when its grammar admits nothing more.

Decode plans of several steps (`Scheduler._multi_step_counts`) run constrained rows too. With a
mailbox (`jaxllm.handoff`: one NVIDIA GPU) each step samples under its own mask, filled from the
tokens before it while the plan runs (`handoff.StepwiseMasks`). Elsewhere the rows speculate
(`SequenceGrammar.speculates`): a row samples every token under its first mask or, in its other
mode, without a mask, and the host keeps the longest prefix that one-step plans would sample
(`accept_tokens`); the scheduler rolls the row back to its end. Where the mask
commutes with the draw (`mask_commutes`), a token drawn under the first mask is such a token
when its own mask allows it and allows nothing the first did not (the best token of the first
mask is the best of any part of it that holds it); one drawn without a mask, when its own mask
allows it. The first mask suits a grammar whose masks stay alike (a string's characters, random
weights); drawing without suits a model that follows the grammar through changing ones (a
trained model through a JSON object's keys).

The grammars come from llguidance, or from xgrammar where it takes the spec and is installed
(`jaxllm.matchers`); llguidance is an optional dependency (`pip install 'jaxllm[structured]'`),
xgrammar one more (`jaxllm[xgrammar]`), each imported on first use.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict

import numpy as np

from jaxllm.matchers import MASK_THREADS, LLGuidance, XGrammar, import_library, llguidance_grammar
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# The distinct specs whose compiled grammars are kept, the least recently used dropped first:
# llguidance's hold MASK_THREADS matchers (a schema of 20 keys ~0.25 MiB each, on a CPU).
COMPILED_GRAMMARS = 64
# A row speculates while a plan is expected to keep at least half its tokens, from the row's
# recent acceptance in its mode (keeping 77% of them, one H200 stream ran at 482 vs 444 tok/s at
# one step a plan; docs/performance.md); else it takes the other mode. When that fails at once
# too, it waits this many one-step plans before it tries again (under the first mask), twice as
# many after each such wait, up to the second figure.
SPECULATION_WAIT = (16, 256)
# The weight of a row's earlier plans in its acceptance, per plan.
ACCEPTANCE_DECAY = 0.75
# The longest a step waits for a grammar's compile (nothing else to run): Ctrl-C, held back
# while a step runs, is taken between two steps.
COMPILE_WAIT_SECONDS = 0.1


@dataclasses.dataclass
class Speculation:
    """Constrained rows' tokens past the first in plans of several steps, those accepted, the
    host's seconds checking them (their masks filled; the device waits for the next plan), and
    the plans planned before the tokens of the one before were checked (`Engine.step`)."""

    tokens: int = 0
    accepted: int = 0
    seconds: float = 0.0
    plans_ahead: int = 0


class SequenceGrammar:
    """One sequence's matcher, made by its grammar's library once the grammar is compiled (of
    llguidance's compiled copies, the `family`th)."""

    __slots__ = (
        "_backoff", "_compiled", "_family", "_stats", "_switched", "_tried", "_wait", "_won",
        "first_mask", "library", "matcher", "unmasked",
    )  # fmt: skip

    def __init__(self, compiled: concurrent.futures.Future, family: int, stats: Speculation):
        self._compiled = compiled
        self._family = family
        self._stats = stats
        self.library = None  # `jaxllm.matchers.LLGuidance` or `XGrammar`, once `ready`
        self.matcher = None  # the library's matcher, once `ready`
        # NOTE: per mode (first mask, unmasked): later tokens kept and tried, decayed
        self._won, self._tried = [0.0, 0.0], [0.0, 0.0]
        self.unmasked = False  # the row's mode: its speculative plans' tokens drawn unmasked
        self._switched = False  # the last plan failed in the other mode
        self._backoff = 0  # the one-step plans of the last wait
        self._wait = 0  # one-step plans left before the row speculates again
        self.first_mask: np.ndarray | None = None  # the mask of its speculative plan's first step

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

    @property
    def speculates(self) -> bool:
        """Whether the row may take plans of several steps (speculative; `settle`)."""
        return self._wait == 0

    def settle(self, kept: int, tried: int) -> None:
        """Counts a speculative plan that kept `kept` of the row's `tried` tokens (all but the
        first speculated; unmasked, the first too); the row speculates on while its mode pays,
        else takes the other mode, or waits if that one just failed (`SPECULATION_WAIT`)."""
        later, mode = max(kept - 1, 0), self.unmasked
        self._stats.tokens += tried - 1
        self._stats.accepted += later
        self._won[mode] = ACCEPTANCE_DECAY * self._won[mode] + later
        self._tried[mode] = ACCEPTANCE_DECAY * self._tried[mode] + later + (kept < tried)
        if self._pays(mode, tried):
            self._backoff, self._switched = 0, False
        elif not self._switched:
            self.unmasked, self._switched = not mode, True
        else:
            first, most = SPECULATION_WAIT
            self._backoff = self._wait = min(max(2 * self._backoff, first), most)
            self.unmasked = self._switched = False

    def _pays(self, mode: bool, tried: int) -> bool:
        """Whether a plan of `tried` tokens in `mode` is expected to keep at least half."""
        p = (self._won[mode] + 1) / (self._tried[mode] + 2)  # a token's acceptance
        return 2 * sum(p**k for k in range(tried)) >= tried


def mask_commutes(params: SamplingParams) -> bool:
    """Whether a row draws the same token with or without its mask whenever the mask allows the
    token drawn without: greedy rows, and rows without top-k, top-p or min-p (Gumbel-max over
    the allowed tokens, the same noise: `model.sampler`); filters of masked logits keep others."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0)


def accept_tokens(plan, tokens: list[list[int]], counts: list[int]) -> dict[int, int]:
    """Advances the matcher of each row of a `StepPlan` that samples under a live grammar past
    the row's tokens (`tokens[row][:counts[row]]`), the rows in parallel; returns how many each
    such row keeps. A token the mask did not allow (it allowed none) leaves the matcher in an
    error state, which `is_terminated` reports. A plan of several steps keeps the longest
    prefix of each row that one-step plans would sample (the module's docstring): none, where
    a row drew its first token unmasked and its mask did not allow it."""
    rows = grammar_rows(plan)
    if not rows:
        return {}
    start = time.perf_counter()
    speculative = plan.bucket.num_steps > 1
    live = [  # a first token drawn unmasked is checked too
        (row, grammar)
        for row, grammar in rows
        if not speculative or not grammar.unmasked or _allows(grammar.first_mask, tokens[row][0])
    ]
    consume_tokens([(grammar, tokens[row][0]) for row, grammar in live])
    kept = dict.fromkeys((row for row, _ in rows), 0) | dict.fromkeys((row for row, _ in live), 1)
    if not speculative:
        for _, grammar in rows:
            grammar._wait = max(0, grammar._wait - 1)
        return kept
    refused = {row: ~grammar.first_mask for row, grammar in live}  # by the first mask
    for step in range(1, max(counts)):
        live = [(row, g) for row, g in live if step < counts[row] and not g.is_terminated]
        if not live:
            break
        masks = np.empty((len(live), live[0][1].first_mask.size), np.int32)
        fill_masks([(index, grammar) for index, (_, grammar) in enumerate(live)], masks)
        live = [
            (row, grammar)
            for mask, (row, grammar) in zip(masks, live, strict=True)
            if _allows(mask, tokens[row][step])
            # drawn under the first mask: its own allows nothing the first did not
            and (grammar.unmasked or not (mask & refused[row]).any())
        ]
        if not live:
            break
        consume_tokens([(grammar, tokens[row][step]) for row, grammar in live])
        for row, _ in live:
            kept[row] += 1
    for row, grammar in rows:
        grammar.settle(kept[row], counts[row])
    rows[0][1]._stats.seconds += time.perf_counter() - start
    return kept


def ahead_holds(ahead, plan, accepted: dict[int, int]) -> bool:
    """Whether `ahead`, a `StepPlan` made while `plan` ran (`Scheduler.plan_ahead`), stands
    now that `accept_tokens` checked `plan`'s tokens: every constrained row of `plan` kept them
    all, and `ahead`'s grammars go on (live, and still speculating: `SequenceGrammar.settle`)."""
    if any(kept < plan.num_new_tokens[row] for row, kept in accepted.items()):
        return False
    grammars = [seq.grammar for seq in ahead.seqs if seq.grammar is not None]
    return all(grammar.speculates and not grammar.is_terminated for grammar in grammars)


def check(params: StructuredOutputsParams) -> None:
    """Checks `params`' schema, regex or grammar without a tokenizer (the command line, before
    an engine starts); `Grammars.compile` checks it again with the engine's.

    Raises:
        ValueError: an invalid schema, regex or grammar, naming the field and the reason.
        ImportError: llguidance is not installed, naming the extra that brings it.
    """
    llguidance_grammar(import_library("llguidance"), params, None)


def _allows(mask: np.ndarray, token: int) -> bool:
    """Whether a row of a token bitmask allows `token`."""
    return bool((mask[token // 32] >> (token % 32)) & 1)


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

    Mutates: `compile` caches the COMPILED_GRAMMARS distinct specs used last; the sequences'
    grammars count their speculated tokens in `speculation`.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._llguidance: LLGuidance | None = None
        self._xgrammar: XGrammar | bool | None = None  # False: not installed
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-grammar")
        self._compiled: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        # Each compiled grammar's next family: its sequences spread over all of them.
        self._families: dict[concurrent.futures.Future, itertools.cycle] = {}
        self.speculation = Speculation()

    def _library(self) -> LLGuidance:
        """llguidance for the engine's tokenizer, set up on first use.

        Raises:
            ImportError: llguidance is not installed, naming the extra that brings it.
        """
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
        kind, text = params.spec
        key = (kind, text, params.disable_any_whitespace)
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
        return SequenceGrammar(compiled, next(families), self.speculation)

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
        constrained rows (`grammar_rows`) filled in parallel. A speculative plan's rows keep
        theirs (`SequenceGrammar.first_mask`, for `accept_tokens`). NOTE: only those: kept for
        every plan, 256 rows of a JSON schema filled in 2.16 vs 1.82 ms (docs/performance.md)."""
        rows, num_rows = grammar_rows(plan), plan.bucket.num_sampled
        words = -(-self.vocab_size // 32)
        mask = np.empty((num_rows, words), np.int32)  # NOTE: the libraries write whole rows
        free = np.ones(num_rows, bool)
        free[[row for row, _ in rows]] = False
        mask[free] = -1
        fill_masks(rows, mask)
        for row, grammar in rows if plan.speculative else ():
            grammar.first_mask = mask[row]
            if grammar.unmasked:  # its tokens drawn without a mask, checked against this one
                grammar.first_mask = mask[row].copy()
                mask[row] = -1
        return mask
