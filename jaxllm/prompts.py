"""The prompts `LLM.generate` takes, in vLLM's forms, parsed into one list in one place (no jax);
`LLM.chat`'s conversations (`parse_conversations`); a call's sampling params (`one_per_prompt`).

One prompt is:
  - a string: text, which the caller tokenizes;
  - token ids: a list or tuple of integers (numpy's and 0-d integer arrays included, bools
    not), or a 1-d array of an integer dtype (numpy's, or another library's that numpy reads:
    jax's, a CPU torch tensor);
  - vLLM's `TextPrompt` {"prompt": str} or `TokensPrompt` {"prompt_token_ids": token ids}, which
    may hold the "prompt" its ids came from (the output's prompt).

A call takes one prompt or an ordered collection of them (a list, a tuple, an iterator). A list
whose first item is a number is one prompt of token ids, as in vLLM. Collections without an order
(sets, dicts of prompts) and bytes are refused. Whether token ids lie in the vocabulary is the
engine's check.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jinja2
import numpy as np

from jaxllm.fields import as_int, check_flag, shown
from jaxllm.sampling_params import SEED_LIMIT, SamplingParams

TokenIds = Sequence[int] | np.ndarray
Prompt = str | TokenIds | dict[str, Any]

ALLOWED = (
    "a string, token ids (a list, tuple or 1-d integer array), {'prompt': str} or "
    "{'prompt_token_ids': token ids} (with the 'prompt' they came from, if known)"
)


class ParsedPrompt(NamedTuple):
    """One prompt: its text (to tokenize), or its token ids and the text they came from (None
    where not given)."""

    text: str | None
    token_ids: list[int] | None


def parse_prompts(prompts: Prompt | Iterable[Prompt]) -> list[ParsedPrompt]:
    """The prompts of one call, in order; an empty collection gives [].

    Raises:
        ValueError: a form not allowed (bytes, a set, a number, nested lists, a prompt dict with
            an unknown key, token ids that are not integers, a numpy array that is not 1-d of
            an integer dtype), naming the prompt's index (or `prompts`) and what is allowed.
    """
    prompts = _host_array(prompts)
    if isinstance(prompts, set | frozenset):
        raise ValueError(
            f"prompts must be ordered: a list or tuple of prompts, not a {type(prompts).__name__}"
        )
    if isinstance(prompts, bytes | bytearray | memoryview) or not _is_list(prompts):
        return [_parse_one(prompts, 0)]
    items = list(prompts)
    if items and isinstance(_scalar(items[0]), int | float | np.number | np.bool_):
        return [_parse_one(items, 0)]  # one prompt of token ids
    return [_parse_one(prompt, index) for index, prompt in enumerate(items)]


def _parse_one(prompt: object, index: int) -> ParsedPrompt:
    """Prompt number `index` of the call (the index is for error messages)."""
    prompt = _host_array(prompt)
    if isinstance(prompt, str):
        return ParsedPrompt(_text(prompt, index), None)
    if isinstance(prompt, dict):
        return _parse_dict(prompt, index)
    if isinstance(prompt, list | tuple | np.ndarray):
        return ParsedPrompt(None, _token_ids(prompt, index))
    raise ValueError(f"prompt {index}: expected {ALLOWED}, got {_described(prompt)}")


def _parse_dict(prompt: dict, index: int) -> ParsedPrompt:
    """vLLM's TextPrompt, or TokensPrompt (its ids, and their text where it has one)."""
    if unknown := [key for key in prompt if key not in ("prompt", "prompt_token_ids")]:
        raise ValueError(
            f"prompt {index}: unknown key {shown(unknown[0])} in a prompt dict; allowed: "
            "'prompt' (a TextPrompt) or 'prompt_token_ids' (a TokensPrompt, which may also hold "
            "its 'prompt')"
        )
    if not prompt:
        raise ValueError(
            f"prompt {index}: a prompt dict takes 'prompt' or 'prompt_token_ids'; got none"
        )
    text = prompt.get("prompt")
    if text is not None or "prompt_token_ids" not in prompt:
        if not isinstance(text, str):
            raise ValueError(f"prompt {index}: 'prompt' must be a string, got {_described(text)}")
        text = _text(text, index)
    if "prompt_token_ids" not in prompt:
        return ParsedPrompt(text, None)
    tokens = _host_array(prompt["prompt_token_ids"])
    if not isinstance(tokens, list | tuple | np.ndarray):
        raise ValueError(
            f"prompt {index}: 'prompt_token_ids' must be a list, tuple or 1-d integer array of "
            f"token ids, got {_described(tokens)}"
        )
    return ParsedPrompt(text, _token_ids(tokens, index))


def _host_array(value: object) -> object:
    """An array of another library that numpy reads (`__array__`: jax's, a CPU torch tensor) as
    a numpy array; anything else as it is."""
    if isinstance(value, np.ndarray | np.generic) or not hasattr(value, "__array__"):
        return value
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError):  # NOTE: one it cannot read (a GPU tensor)
        return value


def _scalar(value: object) -> object:
    """A 0-d array (numpy's or another library's) as its numpy scalar; anything else as it is
    (not copied to the host)."""
    if getattr(value, "ndim", None) != 0:
        return value
    value = _host_array(value)
    return value[()] if isinstance(value, np.ndarray) else value


def _text(text: str, index: int) -> str:
    """`text` as a plain str, if it is Unicode the tokenizer can encode (no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError as error:
        raise ValueError(
            f"prompt {index}: not valid Unicode text: {error.reason} at character {error.start}"
        ) from None
    return str(text)


def _token_ids(tokens: list | tuple | np.ndarray, index: int) -> list[int]:
    """`tokens` as a list of Python ints (whether they lie in the vocabulary is not checked)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"prompt {index}: an array of token ids must be 1-d of an integer dtype, "
                f"got shape {tokens.shape} of {tokens.dtype}"
            )
        return tokens.tolist()
    token_ids = [as_int(token) for token in tokens]
    if None in token_ids:  # 0-d arrays (a jax array's elements) read as numpy scalars
        token_ids = [as_int(_scalar(token)) for token in tokens]
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


def chat_prompts(
    tokenizer,
    messages: object,
    *,
    enable_thinking: bool | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> list[str]:
    """The prompt of each conversation of `messages` (`parse_conversations`), through the
    tokenizer's chat template: `options` are vLLM's chat_template, add_generation_prompt,
    continue_final_message and tools, under the template's `chat_template_kwargs`;
    `enable_thinking` is Qwen3's (None: the template's default, thinking on).

    Raises:
        ValueError: a malformed conversation, both add_generation_prompt and
            continue_final_message, or a template that fails on a conversation (its
            `raise_exception`, a syntax error, a value of the wrong type), naming the
            conversation.
        TypeError: chat_template_kwargs not a dict of str keys (other than the template's
            own: conversation, messages, tokenize), or a flag not a bool.
    """
    kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise TypeError(f"chat_template_kwargs must be a dict of str keys, got {shown(kwargs)}")
    if taken := sorted(set(kwargs) & {"conversation", "messages", "tokenize"}):
        raise TypeError(f"chat_template_kwargs may not set {', '.join(taken)}")
    options |= kwargs  # NOTE: as in vLLM, these win
    if enable_thinking is not None:
        options["enable_thinking"] = enable_thinking
    for flag in ("add_generation_prompt", "continue_final_message", "enable_thinking"):
        if options.get(flag) is not None:
            check_flag(flag, options[flag])
    if options.get("add_generation_prompt") and options.get("continue_final_message"):
        raise ValueError("continue_final_message=True needs add_generation_prompt=False")
    options["tokenize"] = False
    prompts = []
    for index, conversation in enumerate(parse_conversations(messages)):
        try:
            prompts.append(tokenizer.apply_chat_template(conversation, **options))
        except (jinja2.TemplateError, TypeError, ValueError) as error:  # the template's own
            raise ValueError(f"conversation {index}: the chat template failed: {error}") from None
    return prompts


def parse_conversations(messages: object) -> list[list[dict[str, Any]]]:
    """The conversations of one `LLM.chat` call: one (a list of message dicts) or a list of
    them. A message's content is a string, or OpenAI's list of text parts
    ({"type": "text", "text": str}), joined with newlines as vLLM does; None or absent only
    beside "tool_calls", whose arguments are parsed from JSON (`_tool_call`).

    Raises:
        ValueError: an empty conversation, a message that is not a dict with a string "role",
            content of another form, or tool call arguments that are not JSON, naming the
            conversation and the message.
    """
    if not _is_list(messages):
        raise ValueError(f"messages must be a list of message dicts, got {_described(messages)}")
    messages = list(messages)
    one = bool(messages) and isinstance(messages[0], dict)
    for index, conversation in enumerate(() if one else messages):
        if not _is_list(conversation):
            raise ValueError(
                f"conversation {index} must be a list of message dicts, got "
                f"{_described(conversation)}"
            )
    conversations = [messages] if one else [list(conversation) for conversation in messages]
    if [] in conversations:
        raise ValueError(f"conversation {conversations.index([])} has no messages")
    return [
        [_message(message, c, m) for m, message in enumerate(conversation)]
        for c, conversation in enumerate(conversations)
    ]


def _is_list(value: object) -> bool:
    """A list (or another sequence or iterator) of prompts, messages or conversations."""
    return isinstance(value, Sequence | Iterator) and not isinstance(value, dict | str)


def _message(message: object, conversation: int, index: int) -> dict[str, Any]:
    """Message `index` of a conversation, its content a string (or None beside tool calls; an
    assistant's None is empty)."""
    where = f"conversation {conversation}, message {index}"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where}: expected a dict with a string 'role', got {shown(message)}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise ValueError(f"{where}: content parts must be text parts, got {shown(content)}")
        if not all(isinstance(part.get("text"), str) for part in content):
            raise ValueError(f"{where}: a text part's 'text' must be a string")
        return message | {"content": "\n".join(part["text"] for part in content)}
    if content is None and message["role"] == "assistant" and "tool_calls" not in message:
        return message | {"content": ""}  # OpenAI's histories may hold such replies
    if not (isinstance(content, str) or (content is None and "tool_calls" in message)):
        raise ValueError(
            f"{where}: 'content' must be a string or a list of text parts, got {shown(content)}"
        )
    if message["role"] == "assistant" and isinstance(message.get("tool_calls"), list):
        return message | {"tool_calls": [_tool_call(call, where) for call in message["tool_calls"]]}
    return message


def _tool_call(call: object, where: str) -> object:
    """An assistant's tool call with its function's arguments as a dict, as templates expect
    them and vLLM passes them: OpenAI's JSON string parsed, None or "" as {}."""
    if not (isinstance(call, dict) and isinstance(call.get("function"), dict)):
        return call
    arguments = call["function"].get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{where}: a tool call's arguments are not JSON ({error}): {shown(arguments)}"
            ) from None
    return call | {"function": call["function"] | {"arguments": arguments}}


def one_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    """A call's `sampling_params` (one for all, or a list or tuple of one per prompt) as one per
    prompt of its `count`.

    Raises:
        ValueError: a list of another length, or anything but SamplingParams.
    """
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * count
    elif isinstance(sampling_params, list | tuple):
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(
                f"got {len(params)} sampling_params for {count} prompts; pass one "
                "SamplingParams or one per prompt"
            )
    else:
        raise ValueError(
            "sampling_params must be None, a SamplingParams or a list of them (one per "
            f"prompt), got {type(sampling_params).__name__} {shown(sampling_params)}"
        )
    for index, param in enumerate(params):
        if not isinstance(param, SamplingParams):
            raise ValueError(
                f"sampling_params[{index}] is not a SamplingParams: got "
                f"{type(param).__name__} {shown(param)}"
            )
    return params


def with_derived_seeds(
    params: list[SamplingParams], engine_seed: int, drawn: int
) -> tuple[list[SamplingParams], int]:
    """`params`, each unseeded one given a derived seed of its own (a stream of its own: the
    hash of the engine's seed and its draw, counted on from `drawn`), and the draws counted."""
    params = list(params)
    for index, param in enumerate(params):
        if param.seed is None:
            drawn += 1
            seed = hash((engine_seed, drawn)) % SEED_LIMIT
            params[index] = dataclasses.replace(param, _derived_seed=seed)
    return params, drawn
