"""The prompts `LLM.generate` takes, in vLLM's forms, parsed into one list in one place (no jax).

One prompt is:
  - a string: text, which the caller tokenizes;
  - token ids: a list or tuple of integers (numpy's included, bools not), or a 1-d numpy array
    of an integer dtype;
  - vLLM's `TextPrompt` {"prompt": str} or `TokensPrompt` {"prompt_token_ids": token ids}.

A call takes one prompt or an ordered collection of them (a list, a tuple, an iterator). A list
whose first item is a number is one prompt of token ids, as in vLLM. Collections without an order
(sets, dicts of prompts) and bytes are refused. Whether token ids lie in the vocabulary is the
engine's check.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxllm.sampling_params import as_int, shown

TokenIds = Sequence[int] | np.ndarray
Prompt = str | TokenIds | dict[str, Any]

ALLOWED = (
    "a string, token ids (a list, tuple or 1-d integer numpy array), {'prompt': str} or "
    "{'prompt_token_ids': token ids}"
)
_TEXT_KEY, _TOKENS_KEY = "prompt", "prompt_token_ids"


class ParsedPrompt(NamedTuple):
    """One prompt: its text (to tokenize), or its token ids (then `text` is None)."""

    text: str | None
    token_ids: list[int] | None


def parse_prompts(prompts: Prompt | Iterable[Prompt]) -> list[ParsedPrompt]:
    """The prompts of one call, in order; an empty collection gives [].

    Raises:
        ValueError: a form not allowed (bytes, a set, a number, nested lists, a prompt dict with
            an unknown key, token ids that are not integers, a numpy array that is not 1-d of
            an integer dtype), naming the prompt's index (or `prompts`) and what is allowed.
    """
    if isinstance(prompts, set | frozenset):
        raise ValueError(
            f"prompts must be ordered: a list or tuple of prompts, not a {type(prompts).__name__}"
        )
    if isinstance(
        prompts, str | dict | np.ndarray | bytes | bytearray | memoryview
    ) or not isinstance(prompts, Sequence | Iterator):
        return [_parse_one(prompts, 0)]
    items = list(prompts)
    if items and isinstance(items[0], int | float | np.number | np.bool_):
        return [_parse_one(items, 0)]  # one prompt of token ids
    return [_parse_one(prompt, index) for index, prompt in enumerate(items)]


def _parse_one(prompt: object, index: int) -> ParsedPrompt:
    """Prompt number `index` of the call (the index is for error messages)."""
    if isinstance(prompt, str):
        return ParsedPrompt(str(prompt), None)
    if isinstance(prompt, dict):
        return _parse_dict(prompt, index)
    if isinstance(prompt, list | tuple | np.ndarray):
        return ParsedPrompt(None, _token_ids(prompt, index))
    raise ValueError(f"prompt {index}: expected {ALLOWED}, got {_described(prompt)}")


def _parse_dict(prompt: dict, index: int) -> ParsedPrompt:
    """vLLM's TextPrompt or TokensPrompt."""
    for key in prompt:
        if key not in (_TEXT_KEY, _TOKENS_KEY):
            raise ValueError(
                f"prompt {index}: unknown key {shown(key)} in a prompt dict; allowed: "
                f"'{_TEXT_KEY}' (a TextPrompt) or '{_TOKENS_KEY}' (a TokensPrompt)"
            )
    if len(prompt) != 1:
        raise ValueError(
            f"prompt {index}: a prompt dict takes one key, '{_TEXT_KEY}' or '{_TOKENS_KEY}'; "
            f"got {'both' if prompt else 'none'}"
        )
    if _TOKENS_KEY in prompt:
        tokens = prompt[_TOKENS_KEY]
        if not isinstance(tokens, list | tuple | np.ndarray):
            raise ValueError(
                f"prompt {index}: '{_TOKENS_KEY}' must be a list, tuple or 1-d integer numpy "
                f"array of token ids, got {_described(tokens)}"
            )
        return ParsedPrompt(None, _token_ids(tokens, index))
    text = prompt[_TEXT_KEY]
    if not isinstance(text, str):
        raise ValueError(f"prompt {index}: '{_TEXT_KEY}' must be a string, got {_described(text)}")
    return ParsedPrompt(str(text), None)


def _token_ids(tokens: list | tuple | np.ndarray, index: int) -> list[int]:
    """`tokens` as a list of Python ints (whether they lie in the vocabulary is not checked)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"prompt {index}: a numpy array of token ids must be 1-d of an integer dtype, "
                f"got shape {tokens.shape} of {tokens.dtype}"
            )
        return tokens.tolist()
    token_ids = [as_int(token) for token in tokens]
    if None in token_ids:
        position = token_ids.index(None)
        raise ValueError(
            f"prompt {index}: token ids must be integers (not bools, floats or lists), got "
            f"{_described(tokens[position])} at position {position}"
        )
    return token_ids


def _described(value: object) -> str:
    hint = "; decode bytes to a str" if isinstance(value, bytes | bytearray) else ""
    return f"{type(value).__name__} {shown(value)}{hint}"
