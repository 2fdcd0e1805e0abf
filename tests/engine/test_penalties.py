"""Penalties, logit bias, allowed tokens and bad words through the whole engine (CPU, float32):
greedy tokens equal transformers' on the same tiny random weights, whatever the scheduler does
(prefix hits, chunked prefill, preemption, multi-step plans beside them) and whatever shares the
batch; slots are recycled cleanly; TP=2 gives TP=1's tokens; bad settings are refused naming
the field, and the engine serves on.

transformers' own `repetition_penalty` covers prompt and output, as vLLM's; presence and
frequency penalties, the bias and the allowed tokens are `VllmProcessors`, vLLM's formulas on
the tokens after the prompt.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from support.engine import NUM_GREEDY_TOKENS, assert_idle, greedy_params
from support.hf import VOCAB_SIZE

from jaxllm import SamplingParams
from jaxllm.sched.processors import bad_word_ids

NUM_TOKENS = 12
GOOD_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]

# The engine settings of tests/engine/test_logprobs.py.
SCHEDULES = {
    "prefix-caching": {},
    "chunked-prefill": {"max_num_batched_tokens": 48, "kvcache_block_size": 32},
    "preemption": {"num_kvcache_blocks": 32, "eviction_policy": "mru"},
    "multi-step": {"num_scheduler_steps": 4},  # plans of penalized requests run one step
}


class VllmProcessors(transformers.LogitsProcessor):
    """vLLM's logit bias (-inf outside the allowed tokens), repetition penalty over prompt and
    output, then frequency and presence penalties over the output (the tokens past the prompt)."""

    def __init__(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        params, vocab = self.params, scores.shape[-1]
        (tokens,) = input_ids
        output = tokens[self.num_prompt_tokens :]
        bias = torch.zeros(vocab, dtype=torch.float32)
        for token, value in (params.logit_bias or {}).items():
            bias[token] += value
        if params.allowed_token_ids is not None:
            outside = torch.ones(vocab, dtype=torch.bool)
            outside[list(params.allowed_token_ids)] = False
            bias[outside] = -torch.inf
        scores = scores + bias
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[tokens] = True
        penalty = params.repetition_penalty
        repeated = torch.where(scores > 0, scores / penalty, scores * penalty)
        scores = torch.where(seen, repeated, scores)
        counts = torch.bincount(output, minlength=vocab).to(torch.float32)
        scores = scores - params.frequency_penalty * counts
        return scores - params.presence_penalty * (counts > 0).to(torch.float32)


_references: dict[tuple, list[int]] = {}


def transformers_greedy(checkpoint, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' greedy `params.max_tokens` tokens with `params`' processing: its own
    `repetition_penalty` where that is all they ask, else `VllmProcessors`."""
    key = (tuple(prompt), repr(params))
    if key not in _references:
        num_tokens = params.max_tokens
        settings = dict(repetition_penalty=params.repetition_penalty)
        if params != greedy_params(num_tokens, **settings):
            processors = [VllmProcessors(len(prompt), params)]
            settings = dict(logits_processor=transformers.LogitsProcessorList(processors))
        _references[key] = checkpoint.greedy(prompt, num_tokens, **settings)
    return _references[key]


def check_greedy(checkpoint, prompts, params, outputs, greedy_reference=None) -> None:
    """Each output equals transformers' (plain greedy ones: `greedy_reference`'s prefix)."""
    for index, (prompt, param, output) in enumerate(zip(prompts, params, outputs, strict=True)):
        if not param.processes_logits and greedy_reference is not None:
            expected = greedy_reference[index][: param.max_tokens]
        else:
            expected = transformers_greedy(checkpoint, prompt, param)
        assert output.token_ids == expected, f"request {index}: {param}"


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_repetition_penalty_equals_transformers(
    schedule, make_llm, checkpoint, greedy_prompts, greedy_reference, monkeypatch
):
    """Penalized and plain requests in one batch, twice: each prompt penalized in one pass and
    plain in the other, the second pass from the prefix cache. Plain requests run longer, so
    multi-step plans follow the penalized requests' last step."""
    llm = make_llm(**SCHEDULES[schedule])
    prompts, references = greedy_prompts[2:9], greedy_reference[2:9]  # 15 to 200 tokens
    penalized = greedy_params(NUM_TOKENS, repetition_penalty=1.3)
    plain = greedy_params(NUM_GREEDY_TOKENS)
    plans = []
    execute = llm.engine.runner.execute
    monkeypatch.setattr(
        llm.engine.runner,
        "execute",
        lambda plan, *masks: plans.append(plan) or execute(plan, *masks),
    )
    for first in (0, 1):
        params = [penalized if (i + first) % 2 == 0 else plain for i in range(len(prompts))]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        check_greedy(checkpoint, prompts, params, outputs, references)
    if schedule == "prefix-caching":
        assert sum(output.num_cached_tokens for output in outputs) > 0
    writes = sum(len(plan.processors.writes) for plan in plans if plan.processors is not None)
    num_penalized = len(prompts)  # each prompt in one of the passes
    if schedule == "preemption":  # preempted penalized requests: their slots written again
        assert writes > num_penalized
    else:
        assert writes == num_penalized
    if schedule == "multi-step":
        assert any(plan.bucket.num_steps > 1 for plan in plans)
    changed = [
        transformers_greedy(checkpoint, prompt, penalized) != reference[:NUM_TOKENS]
        for prompt, reference in zip(prompts, references, strict=True)
    ]
    assert sum(changed) >= 3  # the penalty changes most outputs: the test sees it applied
    assert_idle(llm)


def test_presence_frequency_and_bias_equal_vllm_formulas(
    llm, checkpoint, greedy_prompts, greedy_reference
):
    """Positive and negative penalties over the output, with a bias (and one with a repetition
    penalty, applied after the bias), beside plain requests."""
    prompts, references = greedy_prompts[3:9], greedy_reference[3:9]
    bias = {references[3][0]: -4.0, references[4][1]: 2.5, 17: 1.5}
    params = [
        greedy_params(NUM_TOKENS, presence_penalty=0.8, frequency_penalty=0.6, logit_bias=bias),
        # Opposite signs: a token seen once is even, one seen twice penalized (or favored).
        greedy_params(NUM_TOKENS, presence_penalty=-0.5, frequency_penalty=0.5),
        greedy_params(NUM_TOKENS),
        greedy_params(NUM_TOKENS, presence_penalty=1.5, logit_bias=bias, repetition_penalty=1.2),
        greedy_params(NUM_TOKENS, presence_penalty=-1.0, frequency_penalty=-0.4),
        greedy_params(NUM_TOKENS, presence_penalty=0.5, frequency_penalty=-0.5),
    ]

    outputs = llm.generate(prompts, params, use_tqdm=False)

    check_greedy(checkpoint, prompts, params, outputs, references)
    changed = [
        output.token_ids != reference[:NUM_TOKENS]
        for output, param, reference in zip(outputs, params, references, strict=True)
        if param.processes_logits
    ]
    assert sum(changed) >= 3
    assert_idle(llm)


def test_allowed_token_ids(llm, checkpoint, greedy_prompts, greedy_reference):
    """Greedy: transformers' argmax over the allowed tokens; sampled (seeded, three
    completions of one prompt): every token allowed. The allowed tokens are none that the plain
    greedy outputs hold."""
    prompts, references = greedy_prompts[4:7], greedy_reference[4:7]
    used = {token for reference in references for token in reference}
    allowed = [token for token in range(VOCAB_SIZE) if token not in used][::7][:8]
    greedy = greedy_params(NUM_TOKENS, allowed_token_ids=allowed)
    sampled = SamplingParams(
        temperature=0.8,
        seed=5,
        n=3,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
        allowed_token_ids=allowed,
        frequency_penalty=0.5,
    )

    outputs = llm.generate(prompts + prompts[:1], [greedy] * 3 + [sampled], use_tqdm=False)

    check_greedy(checkpoint, prompts, [greedy] * 3, outputs[:3])
    samples = [completion.token_ids for completion in outputs[3].outputs]
    assert all(set(tokens) <= set(allowed) for tokens in samples)
    assert len({tuple(tokens) for tokens in samples}) == 3  # streams of their own
    assert len(set(samples[0])) > 1  # not one token: the allowed set, not a degenerate row
    assert_idle(llm)


def test_logit_bias_of_100_gives_its_token_every_step(llm, greedy_prompts, greedy_reference):
    prompts, references = greedy_prompts[2:5], greedy_reference[2:5]
    used = {token for reference in references for token in reference}
    token = next(token for token in range(VOCAB_SIZE) if token not in used)
    biased = greedy_params(NUM_TOKENS, logit_bias={token: 100.0})
    params = [biased, greedy_params(NUM_TOKENS), biased]

    outputs = llm.generate(prompts, params, use_tqdm=False)

    assert outputs[0].token_ids == outputs[2].token_ids == [token] * NUM_TOKENS
    assert outputs[1].token_ids == references[1][:NUM_TOKENS]
    assert_idle(llm)


def find_bad_word(tokenizer, references, length: int) -> tuple[int, int, tuple[int, ...]]:
    """(prompt index, position, tokens): `length` tokens at `position` of a plain greedy output
    whose text tokenizes back to them alone (no variant after a space)."""
    for index, reference in enumerate(references):
        for position in range(len(reference) - length + 1):
            tokens = tuple(reference[position : position + length])
            word = tokenizer.decode(list(tokens))
            if bad_word_ids(tokenizer, (word,)) == (tokens,):
                return index, position, tokens
    raise AssertionError(f"no plain greedy output holds a usable bad word of {length} tokens")


def holds(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens)))


def test_bad_words_are_never_generated(llm, greedy_prompts, greedy_reference):
    """A bad word of two tokens and one of one token, each taken from a plain greedy output:
    the output follows the plain one until the word would appear, and then never holds it;
    plain requests beside them are unchanged."""
    tokenizer = llm.tokenizer
    pair_index, pair_at, pair = find_bad_word(tokenizer, greedy_reference, 2)
    single_index, single_at, single = find_bad_word(tokenizer, greedy_reference, 1)
    words = [tokenizer.decode(list(word)) for word in (pair, single)]
    plain_index = next(i for i in range(len(greedy_prompts)) if i not in (pair_index, single_index))
    prompts = [greedy_prompts[i] for i in (pair_index, plain_index, single_index)]
    params = [
        greedy_params(NUM_GREEDY_TOKENS, bad_words=[words[0]]),
        greedy_params(NUM_GREEDY_TOKENS),
        greedy_params(NUM_GREEDY_TOKENS, bad_words=[words[1]]),
    ]

    outputs = llm.generate(prompts, params, use_tqdm=False)

    tokens = [output.token_ids for output in outputs]
    reference = greedy_reference[pair_index]
    assert tokens[0][: pair_at + 1] == reference[: pair_at + 1]
    assert tokens[0][pair_at + 1] != pair[1]  # banned after its first token: the ban changed it
    assert not holds(tokens[0], pair)
    assert tokens[1] == greedy_reference[plain_index]
    reference = greedy_reference[single_index]
    assert tokens[2][:single_at] == reference[:single_at]
    assert single[0] not in tokens[2]
    assert_idle(llm)


def test_bad_word_tokens_outside_the_vocabulary(llm, checkpoint, greedy_prompts):
    """The tokenizer's vocabulary is larger than the model's: "a" is token 64, " a" is beyond
    the model's 256. Either the request is refused naming bad_words, or it runs with the ban
    of the token the model has; in any case the engine serves on."""
    word_ids = bad_word_ids(llm.tokenizer, ("a",))
    assert min(min(ids) for ids in word_ids) < VOCAB_SIZE <= max(max(ids) for ids in word_ids)
    (inside,) = (ids[0] for ids in word_ids if ids[0] < VOCAB_SIZE)
    prompt = greedy_prompts[5]
    params = greedy_params(NUM_TOKENS, logit_bias={inside: 10.0}, bad_words=["a"])
    try:
        outputs = llm.generate([prompt], params, use_tqdm=False)
    except ValueError as error:
        assert "bad_words" in str(error)
    else:
        assert inside not in outputs[0].token_ids
    assert_idle(llm)
    penalized = greedy_params(NUM_TOKENS, repetition_penalty=1.3)
    (output,) = llm.generate([prompt], penalized, use_tqdm=False)
    assert output.token_ids == transformers_greedy(checkpoint, prompt, penalized)


def test_seeded_sampling_with_penalties_ignores_its_batch(llm, greedy_prompts):
    params = SamplingParams(
        temperature=0.8,
        seed=11,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
        presence_penalty=0.7,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={5: 3.0, 9: -2.0},
    )
    prompt = greedy_prompts[6]
    (alone,) = llm.generate([prompt], params, use_tqdm=False)
    others = [
        SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS + 3, ignore_eos=True),
        greedy_params(NUM_TOKENS - 4, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, seed=2, max_tokens=NUM_TOKENS, presence_penalty=-1.0),
    ]
    batch = llm.generate(
        [greedy_prompts[3], prompt, greedy_prompts[7], greedy_prompts[4]],
        [others[0], params, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].token_ids == alone.token_ids
    unpenalized = SamplingParams(temperature=0.8, seed=11, max_tokens=NUM_TOKENS, ignore_eos=True)
    (plain,) = llm.generate([prompt], unpenalized, use_tqdm=False)
    assert plain.token_ids != alone.token_ids  # the same stream, processed: other tokens
    assert_idle(llm)


def test_slots_are_recycled(make_llm, checkpoint, greedy_prompts):
    """Ten processed requests, four at a time: each slot serves several requests in turn, each
    written anew; every output equals transformers' alone."""
    llm = make_llm(max_num_seqs=4)
    settings = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=1.2, frequency_penalty=0.5),
        dict(frequency_penalty=-0.6, logit_bias={40: 1.0, 200: 2.0}),
        dict(repetition_penalty=0.8, presence_penalty=0.4),
    ]
    params = [
        greedy_params(NUM_TOKENS - index % 3, **settings[index % len(settings)])
        for index in range(len(greedy_prompts))
    ]

    outputs = llm.generate(greedy_prompts, params, use_tqdm=False)

    check_greedy(checkpoint, greedy_prompts, params, outputs)
    assert_idle(llm)


def test_a_chunked_prompt_keeps_its_stop_tokens(make_llm):
    """A processed request admitted by a chunk short of its prompt's end: the stop token a bias
    makes certain ends it at once, as it does a prompt of one chunk."""
    llm = make_llm(**SCHEDULES["chunked-prefill"])  # 48 tokens a step
    params = SamplingParams(
        temperature=0.0, max_tokens=8, stop_token_ids=[7], logit_bias={7: 100.0}
    )
    prompts = [list(range(10, 40)), list(range(10, 110))]  # one chunk; three chunks

    outputs = llm.generate(prompts, params, use_tqdm=False)

    ends = [(output.outputs[0].token_ids, output.outputs[0].finish_reason) for output in outputs]
    assert ends == [([7], "stop")] * 2
    assert_idle(llm)


def test_tensor_parallel_equals_transformers(make_llm, checkpoint, greedy_prompts):
    """At TP=2 (emulated devices) the processors' state and the logits are replicated."""
    llm = make_llm(tensor_parallel_size=2)
    prompts = greedy_prompts[3:6]
    params = [
        greedy_params(NUM_TOKENS, repetition_penalty=1.3),
        greedy_params(NUM_TOKENS, presence_penalty=0.9, logit_bias={7: 2.0}),
        greedy_params(NUM_TOKENS, repetition_penalty=1.3),
    ]

    outputs = llm.generate(prompts, params, use_tqdm=False)

    check_greedy(checkpoint, prompts, params, outputs)
    assert_idle(llm)


# field -> the settings SamplingParams refuses
BAD_SETTINGS = {
    "presence_penalty": dict(presence_penalty=3.0),
    "frequency_penalty": dict(frequency_penalty=-2.5),
    "repetition_penalty": dict(repetition_penalty=0.0),
    "allowed_token_ids": dict(allowed_token_ids=[]),
    "logit_bias": dict(logit_bias={3: float("inf")}),
    "n": dict(n=0),
    "bad_words": dict(bad_words=[""]),
}


@pytest.mark.parametrize("field", list(BAD_SETTINGS))
def test_invalid_settings_name_the_field(field, llm, checkpoint):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**BAD_SETTINGS[field])
    if field == "n":
        with pytest.raises(ValueError, match=r"SamplingParams\.n must be"):
            SamplingParams(n=-1)
    check_usable(llm, checkpoint)


def test_a_bad_word_of_whitespace_is_refused_before_any_work(llm, checkpoint):
    prefilled = llm.engine.stats.prefill.tokens
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words: '  ' is no token"):
        llm.generate([[1, 2], [3, 4]], [greedy_params(4), greedy_params(4, bad_words=["  "])])
    assert llm.engine.stats.prefill.tokens == prefilled
    check_usable(llm, checkpoint)


# field -> (settings SamplingParams accepts but the model's vocabulary does not, the token)
OUTSIDE_THE_VOCABULARY = {
    "logit_bias": (dict(logit_bias={3: 1.0, VOCAB_SIZE: 2.0}), VOCAB_SIZE),
    "allowed_token_ids": (dict(allowed_token_ids=[4, VOCAB_SIZE + 5]), VOCAB_SIZE + 5),
    "stop_token_ids": (dict(stop_token_ids=[4, VOCAB_SIZE + 1]), VOCAB_SIZE + 1),  # never stops
}


@pytest.mark.parametrize("field", list(OUTSIDE_THE_VOCABULARY))
def test_token_ids_outside_the_vocabulary_are_refused(field, llm, checkpoint):
    """Refused before anything of the call runs (the good request before it included)."""
    settings, token = OUTSIDE_THE_VOCABULARY[field]
    bad = greedy_params(4, **settings)
    steps = llm.engine.stats.prefill.steps + llm.engine.stats.decode.steps
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} names token {token}"):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [greedy_params(4), bad], use_tqdm=False)
    assert llm.engine.stats.prefill.steps + llm.engine.stats.decode.steps == steps
    check_usable(llm, checkpoint)


def check_usable(llm, checkpoint) -> None:
    """Idle, then a plain and a penalized request give transformers' tokens."""
    assert_idle(llm)
    params = [greedy_params(4), greedy_params(6, repetition_penalty=1.3)]
    outputs = llm.generate([GOOD_PROMPT, GOOD_PROMPT], params, use_tqdm=False)
    assert outputs[0].token_ids == checkpoint.greedy(GOOD_PROMPT, 4)
    assert outputs[1].token_ids == transformers_greedy(checkpoint, GOOD_PROMPT, params[1])
    assert_idle(llm)
