"""Stop conditions: eos ids (tokenizer and generation_config.json), stop_token_ids, stop strings,
min_tokens, max_tokens; and token ids the tokenizer does not know."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch
from support.engine import BASE_SETTINGS, assert_idle
from support.hf import VOCAB_SIZE, random_qwen3
from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor
from transformers.convert_slow_tokenizer import bytes_to_unicode

from jaxllm import LLM, SamplingParams
from jaxllm.detokenizer import IncrementalDetokenizer, StopStrings, decode_tokens
from jaxllm.prompts import chat_prompts
from jaxllm.tokenizer import load_tokenizer, qwen3_tokenizer

PROMPT = [11, 22, 33, 44, 55]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def continuation(checkpoint) -> list[int]:
    return checkpoint.greedy(PROMPT, NUM_TOKENS)


def first_new_token(tokens: list[int], start: int) -> int:
    """The index of the first token at or after `start` that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def expected_stop(
    checkpoint, stops: set[int], min_tokens: int = 0, max_tokens: int = NUM_TOKENS
) -> tuple[list[int], str]:
    """What a greedy run gives with these stop ids and min_tokens: transformers' continuation,
    the stop ids banned from its first min_tokens tokens (vLLM's min_tokens; transformers'
    MinNewTokensLengthLogitsProcessor), up to its first stop id."""
    ban = MinNewTokensLengthLogitsProcessor(len(PROMPT), min_tokens, sorted(stops))
    tokens = checkpoint.greedy(PROMPT, max_tokens, logits_processor=LogitsProcessorList([ban]))
    assert not set(tokens[:min_tokens]) & stops
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def greedy(**fields) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": NUM_TOKENS} | fields))


def seeded(**fields) -> SamplingParams:
    """Seeded sampling: reproducible, and varied text even from a random model."""
    return SamplingParams(
        **({"temperature": 1.0, "seed": 42, "max_tokens": NUM_TOKENS, "ignore_eos": True} | fields)
    )


# A min_tokens request's plans run one step while its stop tokens are banned, then several.
@pytest.mark.parametrize("settings", [{}, {"num_scheduler_steps": 4}], ids=["one", "multi"])
def test_stop_token_ids_and_min_tokens(make_llm, checkpoint, continuation, settings):
    llm = make_llm(**settings)
    index = first_new_token(continuation, 3)
    stop = continuation[index]
    later = first_new_token(continuation, index + 2)
    cases = [
        greedy(stop_token_ids=[stop]),
        greedy(stop_token_ids=[stop, continuation[later]]),
        greedy(stop_token_ids=[stop, continuation[later]], min_tokens=index + 2),
        greedy(stop_token_ids=[stop], min_tokens=index + 1),
        greedy(stop_token_ids=[stop], min_tokens=NUM_TOKENS),
        greedy(stop_token_ids=[stop], max_tokens=index),
        greedy(stop_token_ids=[stop], max_tokens=index + 1),  # the last token allowed: a stop
    ]
    outputs = llm.generate([PROMPT] * len(cases), cases, use_tqdm=False)

    for params, output in zip(cases, outputs, strict=True):
        stops = set(params.stop_token_ids)
        expected = expected_stop(checkpoint, stops, params.min_tokens, params.max_tokens)
        assert (output.token_ids, output.finish_reason) == expected, params
    assert outputs[0].token_ids == continuation[: index + 1]  # the stop token is kept
    # Before min_tokens are out, the stop tokens are not sampled: the run takes another path.
    assert stop not in outputs[3].token_ids[: index + 1]
    assert outputs[3].token_ids != outputs[0].token_ids
    assert_idle(llm)


def test_allowed_tokens_that_bans_leave_none_of_are_refused(llm):
    """min_tokens' ban of the stop tokens, one-token bad words ("&" is token 5), or both."""
    with pytest.raises(ValueError, match="allowed_token_ids holds only stop tokens"):
        llm.generate([PROMPT], greedy(allowed_token_ids=[5], stop_token_ids=[5], min_tokens=2))
    with pytest.raises(ValueError, match="allowed_token_ids holds only tokens that bad_words"):
        llm.generate([PROMPT], greedy(allowed_token_ids=[5], bad_words=["&"]))
    with pytest.raises(ValueError, match="allowed_token_ids holds only stop tokens"):
        both = greedy(allowed_token_ids=[5, 6], stop_token_ids=[6], bad_words=["&"], min_tokens=1)
        llm.generate([PROMPT], both)
    assert_idle(llm)
    (output,) = llm.generate([PROMPT], greedy(allowed_token_ids=[5], stop_token_ids=[5]))
    assert (output.token_ids, output.finish_reason) == ([5], "stop")


def test_max_tokens_none_runs_to_max_model_len(llm):
    params = greedy(max_tokens=None, ignore_eos=True)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(output.token_ids) == llm.config.max_model_len - len(PROMPT)
    assert output.finish_reason == "length"
    assert_idle(llm)


def test_eos_from_generation_config(checkpoint, continuation, tmp_path):
    index = first_new_token(continuation, 4)
    eos = continuation[index]
    path = checkpoint.with_generation_config(tmp_path / "eos", eos_token_id=[eos, 250])
    llm = LLM(str(path), **BASE_SETTINGS)
    tokenizer_eos = qwen3_tokenizer().eos_token_id
    assert llm.engine.scheduler.config.eos_token_ids == tuple(sorted({eos, 250, tokenizer_eos}))

    cases = [greedy(), greedy(ignore_eos=True), greedy(min_tokens=index + 2)]
    outputs = llm.generate([PROMPT] * 3, cases, use_tqdm=False)

    assert (outputs[0].token_ids, outputs[0].finish_reason) == (continuation[: index + 1], "stop")
    assert outputs[0].outputs[0].stop_reason == eos  # vLLM's: a stop token, not the eos
    assert (outputs[1].token_ids, outputs[1].finish_reason) == (continuation, "length")
    expected = expected_stop(checkpoint, {eos, 250, tokenizer_eos}, index + 2)
    assert (outputs[2].token_ids, outputs[2].finish_reason) == expected
    assert_idle(llm)


def test_sampling_defaults_from_generation_config(checkpoint, continuation, tmp_path):
    """vLLM's rule: a call without sampling params samples with the model's
    generation_config.json over SamplingParams() (max_new_tokens as max_tokens); LLM.save
    keeps them; a value SamplingParams refuses is refused at start-up, naming the file."""
    fields = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 5, "do_sample": True}
    path = checkpoint.with_generation_config(tmp_path / "defaults", **fields)
    llm = LLM(str(path), **BASE_SETTINGS)
    expected = SamplingParams(temperature=0.0, top_k=20, max_tokens=5)
    assert llm.get_default_sampling_params() == expected
    (output,) = llm.generate([PROMPT], use_tqdm=False)
    (explicit,) = llm.generate([PROMPT], expected, use_tqdm=False)
    assert output.token_ids == explicit.token_ids == continuation[: len(output.token_ids)]
    assert len(output.token_ids) == 5 or output.finish_reason == "stop"

    llm.save(tmp_path / "saved")
    assert LLM(str(tmp_path / "saved"), **BASE_SETTINGS).get_default_sampling_params() == expected
    assert LLM(str(checkpoint.path), **BASE_SETTINGS).get_default_sampling_params() == (
        SamplingParams()
    )
    path = checkpoint.with_generation_config(tmp_path / "bad", temperature=-1.0)
    with pytest.raises(ValueError, match=r"generation_config\.json: SamplingParams\.temperature"):
        LLM(str(path), **BASE_SETTINGS)
    (path / "generation_config.json").write_text("[0.6]")
    with pytest.raises(ValueError, match=r"generation_config\.json must hold a JSON object"):
        LLM(str(path), **BASE_SETTINGS)


@pytest.fixture(scope="module")
def text_continuation(text_llm):
    (output,) = text_llm.generate(["The capital of France is"], seeded(), use_tqdm=False)
    assert len(output.text) > 40
    return output


def test_stop_strings(text_llm, text_continuation):
    text, tokens = text_continuation.text, text_continuation.token_ids
    # A stop string that first shows up a third into the text.
    start = next(
        i for i in range(len(text) // 3, len(text)) if text[i : i + 5] not in text[: i + 4]
    )
    stop = text[start : start + 5]
    decoded = [text_llm.tokenizer.decode(tokens[:n]) for n in range(len(tokens) + 1)]
    completing = next(n for n, prefix in enumerate(decoded) if stop in prefix)

    cases = [
        seeded(stop=[stop]),
        seeded(stop=["never in the text", stop]),
        seeded(stop=[stop], min_tokens=completing + 1),
        seeded(stop=[stop], min_tokens=completing),  # it ends in the min_tokens-th token's text
        seeded(stop=["never in the text", stop], include_stop_str_in_output=True),
    ]
    outputs = text_llm.generate(["The capital of France is"] * 5, cases, use_tqdm=False)

    for output in outputs[:2]:
        assert output.text == text[:start]
        assert output.finish_reason == "stop"
        assert output.token_ids == tokens[:completing]  # the completing token is kept
    # A stop string ending in the text of the first min_tokens tokens does not stop (vLLM's
    # rule); one completed later would.
    later = text.find(stop, start + 1)
    for output in outputs[2:4]:
        assert output.text == (text if later < 0 else text[:later])
        assert len(output.token_ids) > completing
    kept = outputs[4]
    assert kept.text == text[: start + len(stop)] and kept.outputs[0].stop_reason == stop
    assert kept.token_ids == tokens[:completing]
    deltas = list(text_llm.stream("The capital of France is", cases[4]))
    assert "".join(delta.text for delta in deltas) == kept.text
    sent_tokens, sent_text = [], ""
    for delta in deltas[:-1]:  # nothing held back: each delta's text is its tokens' text
        sent_tokens, sent_text = sent_tokens + delta.token_ids, sent_text + delta.text
        assert sent_text == text_llm.tokenizer.decode(sent_tokens)
    assert_idle(text_llm)


def test_the_stop_token_is_in_token_ids_not_in_the_text(text_llm, text_continuation):
    """As in vLLM: the stop token that ends a completion is in its token ids, not in its text,
    and (so) no stop string is searched for in its text."""
    tokenizer, tokens = text_llm.tokenizer, text_continuation.token_ids
    index = next(
        i
        for i in range(3, len(tokens))
        if tokens[i] not in tokens[:i]
        and len(piece := tokenizer.decode(tokens[i : i + 1])) >= 2
        and piece not in tokenizer.decode(tokens[: i + 1])[: -len(piece)]
    )
    piece, eos = tokenizer.decode(tokens[index : index + 1]), tokenizer.eos_token_id
    forced_eos = {"ignore_eos": False, "logit_bias": {eos: 100.0}, "skip_special_tokens": False}
    cases = [
        seeded(stop_token_ids=[tokens[index]]),
        seeded(stop_token_ids=[tokens[index]], stop=[piece]),
        seeded(**forced_eos),
        seeded(**forced_eos, stop=["<|im_end|>"]),
        seeded(stop_token_ids=[tokens[index]], include_stop_str_in_output=True),
        seeded(**forced_eos, include_stop_str_in_output=True),
        seeded(**forced_eos, stop_token_ids=[eos]),  # the eos first, as in vLLM: no reason
        # On the last token max_tokens allows, a stop token still stops (vLLM checks it first).
        seeded(stop_token_ids=[tokens[index]], max_tokens=index + 1),
        seeded(**forced_eos, max_tokens=1),
    ]
    outputs = text_llm.generate(["The capital of France is"] * len(cases), cases, use_tqdm=False)

    for output in [*outputs[:2], outputs[7]]:
        assert (output.token_ids, output.finish_reason) == (tokens[: index + 1], "stop")
        assert output.text == tokenizer.decode(tokens[:index])
        assert output.outputs[0].stop_reason == tokens[index]
    for output in [*outputs[2:4], *outputs[6::2]]:
        assert (output.token_ids, output.text, output.finish_reason) == ([eos], "", "stop")
        assert output.outputs[0].stop_reason is None
    # include_stop_str_in_output: the stop token's text too (vLLM's meaning)
    assert outputs[4].token_ids == tokens[: index + 1]
    assert outputs[4].text == tokenizer.decode(tokens[: index + 1])
    assert (outputs[5].token_ids, outputs[5].text) == ([eos], "<|im_end|>")
    for params, output in zip(cases, outputs, strict=True):
        deltas = list(text_llm.stream("The capital of France is", params))
        assert "".join(delta.text for delta in deltas) == output.text
        assert [token for delta in deltas for token in delta.token_ids] == output.token_ids
    assert_idle(text_llm)


def test_a_stop_tokens_text_is_searched_for_stop_strings_where_it_is_output(text_llm):
    """As in vLLM: with include_stop_str_in_output, a stop token's text is searched for stop
    strings too (the stop reason then the string, the text cut after it)."""
    tokenizer = text_llm.tokenizer
    [hello], eos = tokenizer.encode(" hello"), tokenizer.eos_token_id
    hello_stops = {"allowed_token_ids": [hello], "stop_token_ids": [hello], "stop": ["ell"]}
    eos_stops = {"allowed_token_ids": [eos], "stop": ["<|im_end|>"], "skip_special_tokens": False}
    cases = [
        SamplingParams(**hello_stops, include_stop_str_in_output=True),
        SamplingParams(**eos_stops, include_stop_str_in_output=True),
        SamplingParams(**hello_stops),
        SamplingParams(**eos_stops),
    ]
    outputs = text_llm.generate(["Hi"] * len(cases), cases, use_tqdm=False)

    assert [(o.token_ids, o.text, o.outputs[0].stop_reason) for o in outputs] == [
        ([hello], " hell", "ell"),
        ([eos], "<|im_end|>", "<|im_end|>"),
        ([hello], "", hello),
        ([eos], "", None),
    ]
    for params, output in zip(cases, outputs, strict=True):
        assert "".join(delta.text for delta in text_llm.stream("Hi", params)) == output.text
    assert_idle(text_llm)


def test_a_stop_string_is_searched_for_in_text_past_min_tokens_by_its_own_length():
    """Each stop string must end in the new text: "ab", in the text of the first min_tokens
    tokens, does not stop the output, however long the other stop strings."""
    tokenizer = qwen3_tokenizer()
    tokens = [tokenizer.convert_tokens_to_ids(piece) for piece in ("x", "ab", "c")]
    stops = StopStrings(tokenizer, SamplingParams(stop=["ab", "Q" * 10], min_tokens=2))
    assert [stops(token) for token in tokens] == [False, False, False]
    stops = StopStrings(tokenizer, SamplingParams(stop=["ab", "Q" * 10], min_tokens=1))
    assert [stops(token) for token in tokens[:2]] == [False, True] and stops.text == "x"


def test_chat_applies_the_template(text_llm):
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    (default,) = text_llm.chat(conversation, params, use_tqdm=False)
    (direct,) = text_llm.chat(conversation, params, enable_thinking=False, use_tqdm=False)
    two = text_llm.chat([conversation, conversation], params, use_tqdm=False)

    head = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert default.prompt == head
    assert direct.prompt == head + "<think>\n\n</think>\n\n"
    tokenizer = text_llm.tokenizer
    assert default.prompt_token_ids == tokenizer.encode(head, add_special_tokens=False)
    assert default.prompt_token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert [o.token_ids for o in two] == [default.token_ids] * 2
    assert_idle(text_llm)


def test_chat_takes_vllms_arguments(text_llm):
    question = "What is the capital of France?"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    head = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    # vLLM's order: the third positional argument is use_tqdm.
    names = list(inspect.signature(text_llm.chat).parameters)
    assert names[:3] == ["messages", "sampling_params", "use_tqdm"]
    assert inspect.signature(text_llm.chat).parameters["enable_thinking"].kind.name == (
        "KEYWORD_ONLY"
    )
    (parts,) = text_llm.chat(
        [{"role": "user", "content": [{"type": "text", "text": question}]}], params, False
    )
    assert parts.prompt == head  # OpenAI's text parts, joined
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    (kwargs,) = text_llm.chat([{"role": "user", "content": question}], params, False, **no_thinking)
    assert kwargs.prompt == head + "<think>\n\n</think>\n\n"
    reply = [{"role": "user", "content": question}, {"role": "assistant", "content": "Par"}]
    (continued,) = text_llm.chat(
        reply, params, False, add_generation_prompt=False, continue_final_message=True
    )
    # the template's empty thinking block, then the reply continued
    assert continued.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nPar")
    # vLLM's rule: chat_template_kwargs win over chat's own arguments
    options = {"chat_template_kwargs": {"add_generation_prompt": False}}
    (bare,) = text_llm.chat([{"role": "user", "content": question}], params, False, **options)
    assert bare.prompt == f"<|im_start|>user\n{question}<|im_end|>\n"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    (tools,) = text_llm.chat([{"role": "user", "content": question}], params, False, tools=[tool])
    assert "get_weather" in tools.prompt and tools.prompt.endswith(head.split("user\n")[-1])
    # vLLM's rule: an assistant's reply of None content is an empty one
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": None}]
    empty = [history[0], history[1] | {"content": ""}]
    again = [{"role": "user", "content": question}]
    (none,), (blank,) = (text_llm.chat(h + again, params, False) for h in (history, empty))
    assert none.prompt == blank.prompt
    assert_idle(text_llm)


def tool_call_history(arguments) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]


def test_tool_call_arguments_reach_the_template_as_a_dict(text_llm):
    """OpenAI histories hold a tool call's arguments as a JSON string; as in vLLM, the template
    gets them parsed (None or "" as {}), the caller's messages unchanged; not JSON is refused."""
    tokenizer = text_llm.tokenizer
    (as_dict,) = chat_prompts(tokenizer, tool_call_history({"city": "北京"}))
    as_string = tool_call_history('{"city":"\\u5317\\u4eac"}')
    assert chat_prompts(tokenizer, as_string) == [as_dict]
    assert '"arguments": {"city": "北京"}' in as_dict
    assert as_string[1]["tool_calls"][0]["function"]["arguments"].startswith('{"city":"\\u')
    empty = [chat_prompts(tokenizer, tool_call_history(a)) for a in (None, "", {})]
    assert empty[0] == empty[1] == empty[2] and '"arguments": {}' in empty[0][0]
    with pytest.raises(ValueError, match="message 1: a tool call's arguments are not JSON"):
        chat_prompts(tokenizer, tool_call_history('{"city": '))


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"content": "Hi"}], "conversation 0, message 0: expected a dict with a string 'role'"),
        ([{"role": "user"}], "conversation 0, message 0: 'content' must be a string"),
        ([[{"role": "user", "content": "Hi"}], []], "conversation 1 has no messages"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "content parts must be text parts",
        ),
        ("Hi", "messages must be a list of message dicts"),
        (
            [[{"role": "user", "content": "Hi"}], "oops"],
            "conversation 1 must be a list of message dicts, got str 'oops'",
        ),
        ([7], "conversation 0 must be a list of message dicts, got int 7"),
    ],
)
def test_a_malformed_conversation_is_refused_before_any_work(text_llm, messages, message):
    with pytest.raises(ValueError, match=message):
        text_llm.chat(messages, use_tqdm=False)
    with pytest.raises(ValueError, match="continue_final_message=True needs"):
        text_llm.chat([{"role": "user", "content": "Hi"}], continue_final_message=True)
    assert_idle(text_llm)


def test_token_ids_the_tokenizer_does_not_know(tmp_path):
    """Qwen3's vocab (151,936) is padded past its tokenizer's (151,669): a model that only
    generates such ids, from a prompt of such ids, with a stop string to search for."""
    vocab_size = 151_936
    model = random_qwen3(vocab_size=vocab_size, hidden=32, layers=1)
    unknown = [151_700, 151_935]
    with torch.no_grad():
        head = model.lm_head.weight
        head.zero_()
        direction = torch.randn(head.shape[1])
        # One of the two always wins: their logits are x and -x.
        head[unknown[0]] = direction
        head[unknown[1]] = -direction
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **(BASE_SETTINGS | {"max_num_seqs": 2}))
    prompt = [151_669, 151_800, 151_935, 100, 200]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=6, stop=["x"], skip_special_tokens=False),
    ]

    outputs = llm.generate([prompt, prompt], params, use_tqdm=False)
    streamed = list(llm.stream(prompt, params[1]))

    for output in outputs:
        assert set(output.token_ids) <= set(unknown)
        assert (len(output.token_ids), output.text, output.finish_reason) == (6, "", "length")
    assert "".join(delta.text for delta in streamed) == ""
    assert [t for delta in streamed for t in delta.token_ids] == outputs[1].token_ids
    assert_idle(llm)


# Stop strings on byte-level token streams: characters split over tokens, invalid bytes.

CHAR_OF_BYTE = bytes_to_unicode()
BYTE_OF_CHAR = {char: byte for byte, char in CHAR_OF_BYTE.items()}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def token_of(tokenizer, data: bytes) -> int:
    """The id of the byte-level BPE token whose bytes are exactly `data`."""
    token_id = tokenizer.convert_tokens_to_ids("".join(CHAR_OF_BYTE[b] for b in data))
    assert isinstance(token_id, int), data
    return token_id


def settled_text(tokenizer, token_ids: list[int]) -> str:
    """The text of `token_ids` that no later token can change: their bytes decoded, less a last
    character that some bytes after them change (one whose bytes are incomplete)."""
    tokens = tokenizer.convert_ids_to_tokens(token_ids)
    data = b"".join(bytes(BYTE_OF_CHAR[char] for char in token) for token in tokens)
    text = data.decode(errors="replace")
    futures = [b"a"] + [byte * n for byte in (b"\x80", b"\xbf") for n in (1, 2, 3)]
    if all((data + more).decode(errors="replace").startswith(text) for more in futures):
        return text
    return text[:-1]


def first_hit(tokenizer, token_ids: list[int], stop: list[str]) -> tuple[int | None, str]:
    """Feeds `token_ids` one by one to StopStrings, as the scheduler does; returns how many it
    took to hit (None: no hit) and the text of the output."""
    stop_strings = StopStrings(tokenizer, SamplingParams(stop=stop))
    hit = next((n for n, t in enumerate(token_ids, 1) if stop_strings(t)), None)
    return hit, stop_strings.text if hit else decode_tokens(tokenizer, token_ids)


def test_text_of_byte_tokens(llm):
    """Byte tokens (ids below 256) rarely form valid UTF-8: a stop string of U+FFFDs hits at the
    first token whose settled text holds it; the text ends before it, also when streamed. An
    output cut off inside a character leaves that character out (vLLM's text holds no
    incomplete one)."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB_SIZE, 9).tolist() for _ in range(8)]
    stop = "\ufffd\ufffd"
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, stop=[stop])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = output.token_ids
        settled = [settled_text(llm.tokenizer, tokens[:n]) for n in range(len(tokens) + 1)]
        hit = next((n for n, text in enumerate(settled) if stop in text), None)
        if output.finish_reason == "stop":
            assert (len(tokens), output.text) == (hit, settled[-1][: settled[-1].index(stop)])
        else:
            assert (hit, output.text) == (None, settled[-1])
        streamed = list(llm.stream(prompt, params))
        assert "".join(delta.text for delta in streamed) == output.text
    assert {o.finish_reason for o in outputs} == {"stop", "length"}


def test_an_output_cut_off_inside_a_character_leaves_it_out(llm):
    """Lead bytes alone: each is settled as an invalid character (U+FFFD) by the next, the last
    is incomplete and left out, streamed or not."""
    lead = token_of(llm.tokenizer, b"\xe4")
    for max_tokens, text in ((1, ""), (3, "\ufffd\ufffd")):
        params = SamplingParams(max_tokens=max_tokens, allowed_token_ids=[lead], ignore_eos=True)
        [output] = llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert (output.token_ids, output.text) == ([lead] * max_tokens, text)
        assert "".join(delta.text for delta in llm.stream([1, 2, 3], params)) == text


def test_stop_string_completed_by_a_token_that_starts_another_character(tokenizer):
    # "两" is E4 B8 A4 and "한" is ED 95 9C: the token A4 ED ends one and starts the other.
    ids = [
        *tokenizer.encode("Hi "),
        token_of(tokenizer, b"\xe4\xb8"),
        token_of(tokenizer, b"\xa4\xed"),
    ]
    assert tokenizer.decode(ids) == "Hi 两\ufffd"
    completed = [token_of(tokenizer, bytes([b])) for b in b"\x95\x9c"]
    assert tokenizer.decode(ids + completed) == "Hi 两한"
    assert first_hit(tokenizer, ids + completed, ["两"]) == (len(ids), "Hi ")
    assert first_hit(tokenizer, ids + completed, ["两한"]) == (len(ids) + 2, "Hi ")
    # The incomplete character after "两" never completes: "两" is still found at once.
    assert first_hit(tokenizer, ids + completed[:1] * 3, ["两"]) == (len(ids), "Hi ")


def test_of_stop_strings_in_one_tokens_text_the_one_that_ends_first_stops(tokenizer):
    """As the text would show them character by character: in " hello", "ell" ends before
    "hello", though it starts after; of two that end alike, the first listed. (vLLM's
    `check_stop_strings` takes the first listed that is found: "hello".)"""
    [hello] = tokenizer.encode(" hello")
    assert first_hit(tokenizer, [hello], ["hello", "ell"]) == (1, " h")
    assert first_hit(tokenizer, [hello], ["llo", "hello"]) == (1, " he")
    stop_strings = StopStrings(tokenizer, SamplingParams(stop=["lo", "hello"]))
    assert stop_strings(hello) and stop_strings.matched == "lo"
    through = StopStrings(
        tokenizer, SamplingParams(stop=["hello", "ell"], include_stop_str_in_output=True)
    )
    assert through(hello) and (through.matched, through.text) == ("ell", " hell")


def test_stop_string_with_replacement_characters(tokenizer):
    chinese = [token_of(tokenizer, bytes([b])) for b in "中".encode()]  # E4 B8 AD
    invalid, lead = token_of(tokenizer, b"\xff"), chinese[0]
    # While incomplete, "中" decodes to U+FFFD: a placeholder the stop string must not match.
    assert [tokenizer.decode(chinese[:n]) for n in (1, 2, 3)] == ["\ufffd", "\ufffd", "中"]
    assert first_hit(tokenizer, chinese, ["\ufffd"]) == (None, "中")
    # FF is never valid UTF-8: its U+FFFD is in the text for good, even before a placeholder.
    assert first_hit(tokenizer, [*chinese, invalid, lead], ["\ufffd"]) == (4, "中")
    assert first_hit(tokenizer, [*chinese, invalid, lead], ["中\ufffd"]) == (4, "")
    # A lead byte followed by another: the first one's U+FFFD is settled by the second.
    assert first_hit(tokenizer, [lead] * 3, ["\ufffd\ufffd"]) == (3, "")
    assert first_hit(tokenizer, [lead, invalid], ["\ufffd\ufffd"]) == (2, "")


def test_stop_strings_on_random_byte_level_streams(tokenizer):
    """Random streams of byte tokens and multi-byte tokens (characters split over tokens, some
    never completed, invalid bytes): a stop string hits at the first token whose settled text
    holds it, the text ends right before it, and the streamed text (held back by the longest
    stop string less one character, as in `LLM.stream`) never runs past the final text."""
    pieces = [b"a", b" b", b"\xe4", b"\xf0", b"\xed", b"\x80", b"\x95", b"\x98", b"\x9c", b"\x9f"]
    pieces += [b"\xb8", b"\xad", b"\xff", b"\xa4\xed", b"\x92\xe1\x9e", "世界".encode()]
    pool = [token_of(tokenizer, piece) for piece in pieces]
    rng = random.Random(0)
    hits = 0
    for _ in range(300):
        ids = rng.choices(pool, k=10)
        full = tokenizer.decode(ids)
        # Half the stop strings come from another stream: not all of them hit.
        source = full if rng.random() < 0.5 else tokenizer.decode(rng.choices(pool, k=10))
        start = rng.randrange(len(source))
        stop = [source[start : start + rng.randint(1, 3)], "never"]
        settled = [settled_text(tokenizer, ids[:n]) for n in range(len(ids) + 1)]
        hit = next((n for n, text in enumerate(settled) if stop[0] in text), None)
        text = settled[hit][: settled[hit].index(stop[0])] if hit else full
        assert first_hit(tokenizer, ids, stop) == (hit, text), (ids, stop)

        detokenizer, shown = IncrementalDetokenizer(tokenizer), ""
        for token in ids[: (hit or len(ids) + 1) - 1]:
            detokenizer.step(token)
            shown = detokenizer.text[: max(len(shown), len(detokenizer.text) - len("never") + 1)]
        assert text.startswith(shown)
        hits += hit is not None
    assert 150 < hits < 290
