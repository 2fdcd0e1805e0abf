"""Stop conditions: eos ids (tokenizer and generation_config.json), stop_token_ids, stop strings,
min_tokens, max_tokens; and token ids the tokenizer does not know."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.engine import BASE_SETTINGS, assert_idle
from support.hf import VOCAB_SIZE, random_qwen3

from jaxllm import LLM, SamplingParams
from jaxllm.tokenizer import qwen3_tokenizer

PROMPT = [11, 22, 33, 44, 55]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def continuation(checkpoint) -> list[int]:
    return checkpoint.greedy(PROMPT, NUM_TOKENS)


def first_new_token(tokens: list[int], start: int) -> int:
    """The index of the first token at or after `start` that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def expected_stop(tokens: list[int], stops: set[int], min_tokens: int) -> tuple[list[int], str]:
    """What a greedy run of `tokens` gives with these stop ids and min_tokens."""
    for i, token in enumerate(tokens):
        if token in stops and i + 1 >= min_tokens:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def greedy(**fields) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": NUM_TOKENS} | fields))


def seeded(**fields) -> SamplingParams:
    """Seeded sampling: reproducible, and varied text even from a random model."""
    return SamplingParams(
        **({"temperature": 1.0, "seed": 42, "max_tokens": NUM_TOKENS, "ignore_eos": True} | fields)
    )


def test_stop_token_ids_and_min_tokens(llm, continuation):
    index = first_new_token(continuation, 3)
    stop = continuation[index]
    later = first_new_token(continuation, index + 2)
    cases = [
        greedy(stop_token_ids=[stop]),
        greedy(stop_token_ids=[stop, continuation[later]]),
        greedy(stop_token_ids=[stop, continuation[later]], min_tokens=index + 2),
        greedy(stop_token_ids=[stop], min_tokens=NUM_TOKENS),
        greedy(stop_token_ids=[stop], max_tokens=index),
    ]
    outputs = llm.generate([PROMPT] * len(cases), cases, use_tqdm=False)

    for params, output in zip(cases, outputs, strict=True):
        tokens, reason = expected_stop(
            continuation[: params.max_tokens], set(params.stop_token_ids), params.min_tokens
        )
        assert (output.token_ids, output.finish_reason) == (tokens, reason), params
    assert len(outputs[0].token_ids) == index + 1  # the stop token is kept
    assert index + 2 <= len(outputs[2].token_ids) <= later + 1  # min_tokens passed the first
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
    assert (outputs[1].token_ids, outputs[1].finish_reason) == (continuation, "length")
    tokens, reason = expected_stop(continuation, {eos, 250}, index + 2)
    assert (outputs[2].token_ids, outputs[2].finish_reason) == (tokens, reason)
    assert_idle(llm)


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
    ]
    outputs = text_llm.generate(["The capital of France is"] * 3, cases, use_tqdm=False)

    for output in outputs[:2]:
        assert output.text == text[:start]
        assert output.finish_reason == "stop"
        assert output.token_ids == tokens[:completing]  # the completing token is kept
    # Before min_tokens a stop string does not stop; one completed later would.
    later = text.find(stop, start + 1)
    assert outputs[2].text == (text if later < 0 else text[:later])
    assert len(outputs[2].token_ids) > completing
    assert_idle(text_llm)


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


def test_text_of_byte_tokens(llm):
    """Byte tokens (ids below 256) rarely form valid UTF-8: the text is still the output tokens
    decoded, cut before the first stop string."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB_SIZE, 9).tolist() for _ in range(8)]
    stop = "\ufffd\ufffd"
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, stop=[stop])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs:
        full = llm.tokenizer.decode(output.token_ids)
        if output.finish_reason == "stop":
            assert output.text == full[: full.index(stop)]
        else:
            assert output.text == full
    assert {o.finish_reason for o in outputs} == {"stop", "length"}
