"""`jaxllm.prompts.parse_prompts`: vLLM's prompt forms in, one list of (text, token ids) out;
every form refused names the prompt's index (or `prompts`) and what is allowed (no engine)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm.prompts import ParsedPrompt, parse_prompts

TOKENS = [5, 6, 7]
TOKEN_PROMPT, TEXT_PROMPT = ParsedPrompt(None, TOKENS), ParsedPrompt("Hi", None)
ONE_TOKEN_PROMPT = [TOKEN_PROMPT]

ACCEPTED = {
    "text": ("Hi", [TEXT_PROMPT]),
    "token list": (TOKENS, ONE_TOKEN_PROMPT),
    "token tuple": (tuple(TOKENS), ONE_TOKEN_PROMPT),
    "numpy token ids": ([np.int64(5), np.int32(6), np.uint8(7)], ONE_TOKEN_PROMPT),
    "int32 array": (np.array(TOKENS, np.int32), ONE_TOKEN_PROMPT),
    "uint64 array": (np.array(TOKENS, np.uint64), ONE_TOKEN_PROMPT),
    "TextPrompt": ({"prompt": "Hi"}, [TEXT_PROMPT]),
    "TokensPrompt": ({"prompt_token_ids": TOKENS}, ONE_TOKEN_PROMPT),
    "TokensPrompt of an array": ({"prompt_token_ids": np.array(TOKENS)}, ONE_TOKEN_PROMPT),
    "TokensPrompt with its text": (
        {"prompt": "Hi", "prompt_token_ids": TOKENS},
        [ParsedPrompt("Hi", TOKENS)],
    ),
    "a list of each": (
        ["Hi", TOKENS, np.array(TOKENS), {"prompt": "Yo"}, {"prompt_token_ids": (5, 6, 7)}],
        [TEXT_PROMPT, TOKEN_PROMPT, TOKEN_PROMPT, ParsedPrompt("Yo", None), TOKEN_PROMPT],
    ),
    "a tuple of texts": (("a", "b"), [ParsedPrompt("a", None), ParsedPrompt("b", None)]),
    "a generator of prompts": ((p for p in [TOKENS]), ONE_TOKEN_PROMPT),
    "a list of one empty prompt": ([[]], [ParsedPrompt(None, [])]),  # the engine refuses it
    "no prompts": ([], []),
    "an empty tuple": ((), []),
    "out-of-vocabulary ids": ([10**30, -1], [ParsedPrompt(None, [10**30, -1])]),  # the engine's
    "a jax array": (jnp.array(TOKENS), ONE_TOKEN_PROMPT),
    "jax arrays": ([jnp.array(TOKENS), jnp.array(TOKENS, jnp.uint32)], [TOKEN_PROMPT] * 2),
    "TokensPrompt of a jax array": ({"prompt_token_ids": jnp.array(TOKENS)}, ONE_TOKEN_PROMPT),
    "a torch tensor": (torch.tensor(TOKENS), ONE_TOKEN_PROMPT),
    "a list of jax scalars": (list(jnp.array(TOKENS)), ONE_TOKEN_PROMPT),
    "lists of jax scalars": ([list(jnp.array(TOKENS))] * 2, [TOKEN_PROMPT] * 2),
    "TokensPrompt of jax scalars": (
        {"prompt_token_ids": list(jnp.array(TOKENS))},
        ONE_TOKEN_PROMPT,
    ),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_forms(name):
    prompts, expected = ACCEPTED[name]
    parsed = parse_prompts(prompts)
    assert parsed == expected
    for prompt in parsed:
        assert prompt.token_ids is None or {type(t) for t in prompt.token_ids} <= {int}
        assert prompt.text is None or type(prompt.text) is str


REFUSED = {
    "bytes": (b"\x05\x06", r"prompt 0: expected a string, .*got bytes b'\\x05\\x06'; decode"),
    "bytearray": (bytearray(b"ab"), "prompt 0: expected a string, .*got bytearray"),
    "bytes in a list": (["ok", b"ab"], "prompt 1: expected a string, .*got bytes"),
    "a set of prompts": (
        {"a", "b"},
        "prompts must be ordered: a list or tuple of prompts, not a set",
    ),
    "a frozenset": (frozenset(TOKENS), "prompts must be ordered: .* not a frozenset"),
    "a set as a prompt": ([TOKENS, {1, 2}], "prompt 1: expected a string, .*got set"),
    "a dict of prompts": ({0: "a", 1: "b"}, "prompt 0: unknown key 0 in a prompt dict; allowed"),
    "an unknown key": (
        [{"prompt": "a"}, {"prompt": "b", "cache_salt": "x"}],
        "prompt 1: unknown key 'cache_salt' in a prompt dict; allowed: 'prompt' .*"
        "'prompt_token_ids'",
    ),
    "an empty dict": ({}, "prompt 0: a prompt dict takes 'prompt' or 'prompt_token_ids'; got none"),
    "a TokensPrompt's text that is not a string": (
        {"prompt": 3, "prompt_token_ids": TOKENS},
        "prompt 0: 'prompt' must be a string",
    ),
    "text that is not a string": ({"prompt": TOKENS}, "prompt 0: 'prompt' must be a string"),
    "token ids that are text": (
        {"prompt_token_ids": "abc"},
        "prompt 0: 'prompt_token_ids' must be a list, tuple or 1-d integer array",
    ),
    "bool token ids": (
        [True, False],
        r"prompt 0: token ids must be integers .*got bool True at position 0",
    ),
    "numpy bool token id": ([[1, np.bool_(True)]], "prompt 0: .*got bool np.True_ at position 1"),
    "a float token id": (
        [1, 2.5],
        "prompt 0: token ids must be integers .*got float 2.5 at position 1",
    ),
    "a string token id": (
        [["1", 2]],
        "prompt 0: token ids must be integers .*got str '1' at position 0",
    ),
    "nested lists": (
        [[[1, 2]]],
        r"prompt 0: token ids must be integers .*got list \[1, 2\] at posi",
    ),
    "a list in token ids": ([1, [2, 3]], r"prompt 0: .*got list \[2, 3\] at position 1"),
    "a float array": (
        np.array([1.0, 2.0]),
        "prompt 0: an array of token ids must be 1-d of an",
    ),
    "an empty float array": (np.array([]), r"must be 1-d of an integer dtype, got shape \(0,\)"),
    "a 2-d array": (np.ones((2, 3), np.int32), r"prompt 0: .*got shape \(2, 3\) of int32"),
    "a 2-d jax array": (jnp.ones((2, 3), jnp.int32), r"prompt 0: .*got shape \(2, 3\) of int32"),
    "a float jax array": ([jnp.array([1.5])], r"prompt 0: .*1-d of an integer dtype, .*float32"),
    "a 0-d array": ([TOKENS, np.array(3)], r"prompt 1: .*got shape \(\) of int"),
    "a float jax scalar": (
        [[3, jnp.array(1.5)]],
        r"prompt 0: token ids must be integers .*1.5.* at position 1",
    ),
    "a bool jax scalar": (
        [jnp.array(True), 3],
        r"prompt 0: token ids must be integers .*True.* at position 0",
    ),
    "a bool array": (np.array([True]), "must be 1-d of an integer dtype, got shape .* of bool"),
    "a number": (7, "prompt 0: expected a string, token ids .*got int 7"),
    "None": (None, "prompt 0: expected .*got NoneType None"),
    "None in a list": (["a", None], "prompt 1: expected .*got NoneType None"),
    "a float prompt": ([TOKENS, 7.0], "prompt 1: expected a string"),
    "a lone surrogate": (
        ["ok", "abc\ud800"],
        "prompt 1: not valid Unicode text: .* at character 3",
    ),
    "a lone surrogate in a TextPrompt": ({"prompt": "\udcff"}, "prompt 0: not valid Unicode"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_forms_name_the_prompt_and_what_is_allowed(name):
    prompts, pattern = REFUSED[name]
    with pytest.raises(ValueError, match=pattern):
        parse_prompts(prompts)
