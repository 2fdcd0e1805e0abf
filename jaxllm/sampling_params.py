"""Per-request sampling settings, validated at construction (pure Python and numpy, no jax)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxllm.fields import FLAG, Check, as_int, as_real, as_str, as_tuple, check_fields, shown

logger = logging.getLogger(__name__)

# A seed's range: any 64-bit unsigned value (the device keys its stream with all 64 bits).
SEED_LIMIT = 2**64
# The smallest temperature above 0, as vLLM's (which names numerical errors below it).
MIN_TEMPERATURE = 0.01
# NOTE: the device computes in float32: a larger number would be inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's names): exactly one of its fields is set.

    Each sampled token is one the constraint still allows; eos only where the text so far is
    complete, and the request stops ("stop") once the constraint admits nothing more. Needs the
    `structured` extra (llguidance): `pip install 'jaxllm[structured]'`; JSON schemas are
    served faster by xgrammar where the `xgrammar` extra is installed too (`jaxllm.matchers`).

    Attributes:
        json: a JSON schema (a dict, or its text) the output is an instance of.
        regex: a regular expression the whole output matches (Rust's `regex` syntax).
        choice: the output is one of these strings.
        grammar: a context-free grammar, in Lark or GBNF (llama.cpp's EBNF) syntax.
        json_object: the output is any JSON object.
        disable_any_whitespace: JSON without whitespace between its tokens (by default any
            whitespace is allowed there, as JSON allows).

    Raises:
        ValueError: none or several of the fields set, or one of the wrong type (a schema that
            is not JSON, an empty choice list), naming the field.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        check_fields(self, _STRUCTURED_CHECKS, prefix="StructuredOutputsParams.")
        kinds = ("json", "regex", "choice", "grammar")
        given = [kind for kind in kinds if getattr(self, kind) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams: exactly one of json, regex, choice, grammar and "
                f"json_object must be set, got {', '.join(given) or 'none'}"
            )
        try:
            if isinstance(self.json, str):
                json.loads(self.json)
            elif self.json is not None:
                json.dumps(self.json)
        except (TypeError, ValueError) as error:  # a dict holding a set, a circular one
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {error}") from None
        except RecursionError:
            raise ValueError("StructuredOutputsParams.json is nested too deeply") from None

    @property
    def spec(self) -> tuple[str, str]:
        """(kind, text): the constraint as llguidance's `grammar_from` takes it; equal specs
        are one grammar. A schema's keys keep their order: the output's follow it."""
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    Numbers may be Python or numpy scalars (np.float32(0.7), np.int64(8)); they are stored as
    Python int and float. Booleans are not numbers, and flags must be booleans.

    Attributes:
        temperature: 0 means greedy (top_k, top_p and min_p then set off, as vLLM does; n > 1
            gives n equal completions, where vLLM refuses it); otherwise logits are divided by
            it, at least `MIN_TEMPERATURE` (a smaller one is raised to it, with a warning).
            Range [0, inf).
        top_k: keep the k most likely tokens; 0 (or -1) keeps all.
        top_p: keep the smallest set of tokens whose probability, among those min-p and top-k
            keep, reaches top_p, and every token tied with its least likely one (vLLM keeps
            those its sort puts first). Range (0, 1].
        min_p: drop tokens whose probability is below min_p times the top one (before top-k
            and top-p, as vLLM). Range [0, 1].
        max_tokens: generate at most this many tokens (64 by default, where vLLM's is 16).
            Range [1, inf); None: as many as max_model_len leaves (vLLM's meaning).
        min_tokens: eos and stop_token_ids are not sampled, and stop strings not matched in
            the text, until this many tokens are out (vLLM's meaning; with ignore_eos, eos is
            not banned, where vLLM bans the model's).
        ignore_eos: keep generating after the eos token (still stops at max_tokens).
        stop: strings that end the output; the text ends before the stop string (unless
            include_stop_str_in_output).
        stop_token_ids: token ids that end the output (kept in `token_ids`, not in the text,
            as eos).
        include_stop_str_in_output: the text keeps the stop string, or the stop token's
            text, that ended it (vLLM's meaning); streamed text is then not held back.
        seed: makes this request's samples reproducible: its random draws are the same
            whatever else is in the batch. Its logits may round differently with the batch's
            shape (kernels and their sums differ), in bfloat16 enough to flip a near tie, as
            in vLLM. Range [0, 2**64); -1 means None (vLLM's).
        skip_special_tokens: drop special tokens when decoding the text.
        detokenize: False leaves the text empty and logprobs' tokens unnamed (decoded_token
            None), as in vLLM; stop strings need the text.
        n: completions of the prompt; each draws from a stream of its own (seeded: the seed of
            completion i is seed + i).
        logprobs: return each generated token's log-probability and those of the `logprobs`
            most likely tokens (0: the generated token's only); at most the LLM's
            max_logprobs (default 20). Of the model's raw logits, or of the processed ones
            with the LLM's logprobs_mode="processed_logprobs".
        prompt_logprobs: the same for every prompt token but the first (None there). The
            prompt is then computed whole, without prefix-cache hits, in chunks of which every
            row is sampled.
        presence_penalty: subtracted from the logit of every token the output holds (vLLM's
            meaning). Range [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time the output holds it.
            Range [-2, 2].
        repetition_penalty: divides the positive logits, and multiplies the negative ones, of
            the tokens in the prompt or the output (1: off). Range (0, inf).
        logit_bias: {token id: bias} added to those logits before the penalties.
        allowed_token_ids: only these tokens may be sampled; where none of them fits
            `structured_outputs`, the grammar's tokens may be.
        bad_words: words never generated: the last token of each word (and of the word after
            a space) is banned whenever the output ends with the tokens before it.
        structured_outputs: a JSON schema, regex, choice or grammar the output follows
            (`StructuredOutputsParams`). The grammar wins: where it allows only tokens that
            bad_words or min_tokens ban, one of them is sampled, and it ends the output where
            it completes, before min_tokens if so.
        extra_args: the request's metadata for custom code (vLLM's name), e.g. a priority, a
            session or a tenant; eviction policies read it (`cache.eviction.BlockInfo`).
        truncate_prompt_tokens: keep only the prompt's last k tokens (vLLM's left truncation):
            the output's prompt_token_ids are those; -1 keeps as many as max_model_len allows
            (one fewer, so that one token can follow). More than max_model_len is refused.

    Raises:
        ValueError: a value of the wrong type or outside its range, naming the field.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None
    # NOTE: set by the engine (never by users) so that an unseeded request still draws from a
    # stream of its own; excluded from equality so user-visible params compare as expected.
    _derived_seed: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if as_int(self.seed) == -1:  # vLLM's "no seed"
            object.__setattr__(self, "seed", None)
        check_fields(self, _CHECKS, prefix="SamplingParams.", optional={"max_tokens"})
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.greedy:  # NOTE: filters keep the best token: off, as vLLM sets them
            for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
                object.__setattr__(self, name, off)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "SamplingParams.temperature=%s is raised to %s, as vLLM does to avoid numerical "
                "errors; 0 is greedy",
                self.temperature,
                MIN_TEMPERATURE,
            )
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        min_tokens = as_int(self.min_tokens)
        if min_tokens is None or not 0 <= min_tokens <= (self.max_tokens or math.inf):
            raise ValueError(
                f"SamplingParams.min_tokens must be an integer in [0, max_tokens="
                f"{self.max_tokens}], got {shown(self.min_tokens)}"
            )
        object.__setattr__(self, "min_tokens", min_tokens)
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop needs detokenize=True: stop strings are text")

    @property
    def processes_logits(self) -> bool:
        """It asks for penalties, a logit bias, allowed tokens or bad words."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sampling_seed(self) -> int:
        """The seed the device sampler uses for this request (user seed, else engine-derived),
        in [0, 2**64)."""
        return self.seed if self.seed is not None else self._derived_seed or 0


def _stop_string(value: object) -> str | None:
    """A non-empty str of valid Unicode (a lone surrogate is no text a model can write)."""
    try:
        return str(value) if isinstance(value, str) and value.encode("utf-8") else None
    except UnicodeEncodeError:
        return None


def _token_id(value: object) -> int | None:
    token = as_int(value)
    return token if token is not None and token >= 0 else None


def _logit_bias(value: object) -> dict[int, float] | None:
    """A dict of token ids (ints, or strings of them as JSON gives) to finite float32 numbers."""
    if not isinstance(value, dict):
        return None
    bias = {}
    for token, number in value.items():
        if isinstance(token, str) and token.isdecimal():
            token = int(token)
        token, number = _token_id(token), as_real(number)
        if token is None or number is None or not abs(number) <= FLOAT32_MAX:
            return None
        bias[token] = number
    return bias


_STRUCTURED_CHECKS: dict[str, Check] = {
    "json": (
        lambda spec: spec if isinstance(spec, dict | str) else None,
        None,
        "a dict or its JSON text",
    ),
    "regex": (as_str, None, "a string"),
    "choice": (
        lambda choice: None if isinstance(choice, str) else as_tuple(choice, as_str),
        bool,
        "a non-empty list of strings",
    ),
    "grammar": (as_str, None, "a string"),
    "json_object": FLAG,
    "disable_any_whitespace": FLAG,
}
_STRINGS: Check = (
    lambda words: as_tuple(words, _stop_string),
    None,
    "None, a non-empty string or a list of non-empty strings, of valid Unicode",
)
# What each field allows (see `check_fields`); min_tokens, bounded by max_tokens, is checked after.
_CHECKS: dict[str, Check] = {
    "temperature": (
        as_real,
        lambda t: 0.0 <= t <= FLOAT32_MAX,
        "a finite float32 number >= 0 (0 means greedy)",
    ),
    "top_k": (as_int, lambda k: k >= -1, "an integer >= 0 (0 or -1 keeps every token)"),
    "top_p": (as_real, lambda p: 0.0 < p <= 1.0, "a number in (0, 1]"),
    "min_p": (as_real, lambda p: 0.0 <= p <= 1.0, "a number in [0, 1]"),
    "max_tokens": (as_int, lambda n: n >= 1, "None or an integer >= 1"),
    "ignore_eos": FLAG,
    "skip_special_tokens": FLAG,
    "detokenize": FLAG,
    "include_stop_str_in_output": FLAG,
    "stop": _STRINGS,
    "stop_token_ids": (
        lambda ids: as_tuple(ids, _token_id),
        None,
        "None or a list of integers >= 0",
    ),
    "seed": (as_int, lambda seed: 0 <= seed < SEED_LIMIT, "None or an integer in [0, 2**64)"),
    "n": (as_int, lambda n: 1 <= n <= 1024, "an integer in [1, 1024]"),
    "logprobs": (as_int, lambda k: k >= 0, "None or an integer >= 0"),
    "prompt_logprobs": (as_int, lambda k: k >= 0, "None or an integer >= 0"),
    "presence_penalty": (as_real, lambda p: -2.0 <= p <= 2.0, "a number in [-2, 2]"),
    "frequency_penalty": (as_real, lambda p: -2.0 <= p <= 2.0, "a number in [-2, 2]"),
    "repetition_penalty": (
        as_real,
        lambda p: 0.0 < p <= FLOAT32_MAX,
        "a finite float32 number > 0 (1 is off)",
    ),
    "logit_bias": (_logit_bias, None, "None or a dict of token ids >= 0 to finite float32 numbers"),
    "allowed_token_ids": (
        lambda ids: None if isinstance(ids, str) else as_tuple(ids, _token_id),
        bool,
        "None or a non-empty list of integers >= 0",
    ),
    "bad_words": _STRINGS,
    "structured_outputs": (
        lambda value: value if isinstance(value, StructuredOutputsParams) else None,
        None,
        "None or a StructuredOutputsParams",
    ),
    "extra_args": (
        lambda value: value if isinstance(value, dict) else None,
        lambda args: all(isinstance(key, str) for key in args),
        "None or a dict with string keys",
    ),
    "truncate_prompt_tokens": (
        as_int,
        lambda k: k >= 1 or k == -1,
        "None, -1 (as many as max_model_len allows) or an integer >= 1",
    ),
}
