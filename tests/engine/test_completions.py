"""Several completions of one prompt (`SamplingParams.n`): one prefill whose blocks the others
find in the prefix cache, a stream of samples each, streamed per completion."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.engine import BLOCK_SIZE, NUM_GREEDY_TOKENS, assert_idle, greedy_params
from support.hf import VOCAB_SIZE

from jaxllm import SamplingParams


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_n_greedy_completions_share_one_prefill(make_llm, checkpoint, prompt_logprobs):
    """With prompt logprobs too: the first completion computes them, the others reuse its KV."""
    llm = make_llm()
    prompt = np.random.default_rng(11).integers(0, VOCAB_SIZE, 100).tolist()  # 6 full blocks
    expected = checkpoint.greedy(prompt, NUM_GREEDY_TOKENS)
    hits_before = llm.cache_stats().num_hit_tokens
    prefilled_before = llm.engine.stats.prefill.tokens

    params = greedy_params(n=8, prompt_logprobs=prompt_logprobs)
    (output,) = llm.generate(prompt, params, use_tqdm=False)

    assert [c.index for c in output.outputs] == list(range(8))
    assert all(c.finished() for c in output.outputs) and output.finished
    assert all(c.token_ids == expected for c in output.outputs)
    assert output.token_ids == expected  # the first completion's
    full_blocks = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert llm.cache_stats().num_hit_tokens - hits_before == 7 * full_blocks
    # One prefill of the prompt, then each other completion's tokens past its full blocks.
    prefilled = llm.engine.stats.prefill.tokens - prefilled_before
    assert prefilled == len(prompt) + 7 * (len(prompt) - full_blocks)
    if prompt_logprobs is not None:
        assert len(output.prompt_logprobs) == len(prompt)  # the first token's is None
        assert all(len(top) >= prompt_logprobs for top in output.prompt_logprobs[1:])
    assert_idle(llm)


def test_n_samples_are_streams_of_their_own(make_llm):
    llm = make_llm()
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB_SIZE, 40).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=10, n=4, seed=9, ignore_eos=True)

    (alone,) = llm.generate(prompt, params, use_tqdm=False)
    others = [rng.integers(0, VOCAB_SIZE, n).tolist() for n in (7, 60)]
    batch = llm.generate([others[0], prompt, others[1]], params, use_tqdm=False)

    samples = [c.token_ids for c in alone.outputs]
    assert len({tuple(s) for s in samples}) == 4
    assert [c.token_ids for c in batch[1].outputs] == samples
    # Completion i draws the stream of seed + i.
    single = SamplingParams(temperature=1.0, max_tokens=10, seed=9 + 2, ignore_eos=True)
    assert llm.generate(prompt, single, use_tqdm=False)[0].token_ids == samples[2]
    assert_idle(llm)


def stream_and_generate(llm, prompt: str, params: SamplingParams):
    """The texts and token ids that `stream`'s deltas join to, and `generate`'s output."""
    texts, tokens = [""] * params.n, [[] for _ in range(params.n)]
    for delta in llm.stream(prompt, params):
        texts[delta.index] += delta.text
        tokens[delta.index] += delta.token_ids
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    return texts, tokens, output


def test_streamed_completions(text_llm):
    params = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=1, ignore_eos=True)
    texts, tokens, output = stream_and_generate(text_llm, "Once upon a time", params)
    assert texts == [c.text for c in output.outputs]
    assert tokens == [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("stops", [False, True], ids=["free", "one-stops-early"])
def test_streamed_logprobs_join_to_the_outputs(text_llm, stops):
    """As vLLM's streamed outputs: each delta carries its tokens' logprobs, and completion 0's
    first delta the prompt's; with a stop string that ends completion 0 early (its last delta
    from the output) too."""
    prompt = "Once upon a time"
    params = SamplingParams(
        temperature=0.8, max_tokens=30, n=3, seed=1, logprobs=2, prompt_logprobs=1
    )
    if stops:
        (free,) = text_llm.generate(prompt, params, use_tqdm=False)
        text = free.outputs[0].text
        params = dataclasses.replace(params, stop=[text[len(text) // 3 : len(text) // 3 + 3]])
    deltas = list(text_llm.stream(prompt, params))
    (output,) = text_llm.generate(prompt, params, use_tqdm=False)

    lengths = [len(completion.token_ids) for completion in output.outputs]
    assert (output.outputs[0].finish_reason, lengths[0] < max(lengths)) == (
        ("stop", True) if stops else ("length", False)
    )
    for completion in output.outputs:
        own = [delta for delta in deltas if delta.index == completion.index]
        assert [len(d.logprobs) for d in own] == [len(d.token_ids) for d in own]
        assert [entry for d in own for entry in d.logprobs] == list(completion.logprobs)
        prompt_logprobs = [d.prompt_logprobs for d in own]
        if completion.index == 0:
            assert prompt_logprobs[0] == output.prompt_logprobs is not None
            prompt_logprobs = prompt_logprobs[1:]
        assert prompt_logprobs == [None] * len(prompt_logprobs)
    plain = dataclasses.replace(params, logprobs=None, prompt_logprobs=None)
    assert all(
        d.logprobs is None and d.prompt_logprobs is None for d in text_llm.stream("Hi", plain)
    )


def test_a_completion_stopped_early_streams_no_part_of_its_stop_string(text_llm):
    """One completion hits its stop string while the others run on: its deltas still join to
    its text, which ends before the stop string."""
    prompt, base = "Once upon a time", dict(temperature=0.8, max_tokens=30, n=3, seed=1)
    (free,) = text_llm.generate(prompt, SamplingParams(**base, ignore_eos=True), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    params = SamplingParams(**base, ignore_eos=True, stop=[stop])
    texts, tokens, output = stream_and_generate(text_llm, prompt, params)
    first = output.outputs[0]
    assert first.finish_reason == "stop" and stop not in first.text
    assert len(first.token_ids) < max(len(c.token_ids) for c in output.outputs)
    assert texts == [c.text for c in output.outputs]
    assert tokens == [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_n_is_refused(n):
    with pytest.raises(ValueError, match=r"SamplingParams.n must be"):
        SamplingParams(n=n)
