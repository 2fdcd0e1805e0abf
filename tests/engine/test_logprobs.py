"""Logprobs of generated tokens equal transformers' log-softmax, whatever the scheduler does
(prefix hits, chunked prefill, preemption, several decode steps per plan), and the outputs keep
today's shortcuts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from support.engine import assert_idle, greedy_params

from jaxllm import SamplingParams

NUM_TOKENS = 12
TOP = 5

SCHEDULES = {
    "prefix-caching": {},
    "chunked-prefill": {"max_num_batched_tokens": 48, "kvcache_block_size": 32},
    "preemption": {"num_kvcache_blocks": 32, "eviction_policy": "mru"},
    "multi-step": {"num_scheduler_steps": 4},  # plans with logprobs run one step
}


def reference_logprobs(checkpoint, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens), V] transformers' log-softmax before each generated token."""
    with torch.no_grad():
        logits = checkpoint.torch_model(torch.tensor([prompt + tokens])).logits[0]
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def check_logprobs(request_output, reference: np.ndarray, num_top: int) -> None:
    (output,) = request_output.outputs
    assert len(output.logprobs) == len(output.token_ids) == len(reference)
    for token, entries, expected in zip(output.token_ids, output.logprobs, reference, strict=True):
        order = np.argsort(-expected, kind="stable")
        assert entries[token].logprob == pytest.approx(expected[token], abs=1e-4)
        assert entries[token].rank == int(np.sum(expected >= expected[token] - 1e-6))
        top = [i for i, entry in entries.items() if entry.rank <= num_top]
        gaps = -np.diff(expected[order[: num_top + 1]])
        if num_top and gaps.min() > 1e-4:  # no near-tie decides the top ids
            assert sorted(top) == sorted(order[:num_top].tolist())
        for i in top:
            assert entries[i].logprob == pytest.approx(expected[i], abs=1e-4)
    sampled = [e[t].logprob for t, e in zip(output.token_ids, output.logprobs, strict=True)]
    assert output.cumulative_logprob == sum(sampled)  # added up as Python floats, as vLLM does


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_logprobs_equal_transformers(schedule, make_llm, checkpoint, greedy_prompts):
    llm = make_llm(**SCHEDULES[schedule])
    prompts = greedy_prompts[2:8]
    params = greedy_params(NUM_TOKENS, logprobs=TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if schedule == "prefix-caching":  # again, now from the prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert sum(output.num_cached_tokens for output in outputs) > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        check_logprobs(output, reference_logprobs(checkpoint, prompt, output.token_ids), TOP)
    assert_idle(llm)


def test_sampled_tokens_logprobs_alone(llm, checkpoint, greedy_prompts):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, logprobs=0, ignore_eos=True)
    (output,) = llm.generate(greedy_prompts[4], params, use_tqdm=False)
    completion = output.outputs[0]
    assert all(
        list(entries) == [token]
        for token, entries in zip(completion.token_ids, completion.logprobs, strict=True)
    )
    check_logprobs(output, reference_logprobs(checkpoint, greedy_prompts[4], output.token_ids), 0)
    (plain,) = llm.generate(
        greedy_prompts[4],
        SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert plain.token_ids == output.token_ids  # asking for logprobs changes no sample
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_outputs_and_their_shortcuts(llm, greedy_prompts):
    (output,) = llm.generate(greedy_prompts[3], greedy_params(4, stop_token_ids=[]), use_tqdm=False)
    (completion,) = output.outputs
    assert (output.text, output.token_ids, output.finish_reason) == (
        completion.text,
        completion.token_ids,
        completion.finish_reason,
    )
    assert output["text"] == completion.text and output["token_ids"] == completion.token_ids
    assert completion.index == 0 and completion.stop_reason is None
    assert output.finished and output["finished"]  # vLLM's field
    with pytest.raises(KeyError):
        output["nothing"]


def test_stop_reason_names_the_stop_token(llm, greedy_prompts, greedy_reference):
    stop = greedy_reference[5][3]
    (output,) = llm.generate(
        greedy_prompts[5], greedy_params(stop_token_ids=[stop]), use_tqdm=False
    )
    assert output.outputs[0].stop_reason == stop and output.finish_reason == "stop"


def test_logprobs_above_the_cap_are_refused(llm, greedy_prompts):
    with pytest.raises(
        ValueError, match=r"SamplingParams.logprobs=21 is more than max_logprobs=20"
    ):
        llm.generate(greedy_prompts[0], greedy_params(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs must be"):
        SamplingParams(logprobs=-1)
    assert_idle(llm)


def test_logprobs_above_the_vocabulary_are_refused(make_llm, greedy_prompts):
    llm = make_llm(max_logprobs=300)
    vocab = llm.model_config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        too_many = greedy_params(2, **{name: vocab + 1})
        with pytest.raises(ValueError, match=rf"{name}={vocab + 1} is more than the model's"):
            llm.generate([greedy_prompts[0], greedy_prompts[1]], too_many, use_tqdm=False)
    (output,) = llm.generate(greedy_prompts[0], greedy_params(2, logprobs=vocab), use_tqdm=False)
    assert all(len(entry) == vocab for entry in output.outputs[0].logprobs)
    assert_idle(llm)


def test_prompt_logprobs_equal_transformers(make_llm, checkpoint, greedy_prompts):
    """Every prompt token's logprob and top ones, computed in chunks whose every row is sampled;
    a prompt already in the prefix cache is computed again (no hits)."""
    llm = make_llm()
    prompts = [greedy_prompts[6], greedy_prompts[4], greedy_prompts[7]]  # 64, 17, 100 tokens
    asking = greedy_params(4, prompt_logprobs=TOP, logprobs=1)
    params = [asking, greedy_params(4), asking]
    llm.generate(prompts, greedy_params(4), use_tqdm=False)  # fills the prefix cache
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, param in zip(prompts, outputs, params, strict=True):
        if param.prompt_logprobs is None:
            assert output.prompt_logprobs is None and output.num_cached_tokens > 0
            continue
        assert output.num_cached_tokens == 0
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        with torch.no_grad():
            logits = checkpoint.torch_model(torch.tensor([prompt])).logits[0, :-1].double()
        expected = torch.log_softmax(logits, dim=-1).numpy()  # [P - 1, V]: tokens 1 .. P - 1
        completion = dataclasses.replace(
            output.outputs[0],
            token_ids=prompt[1:],
            logprobs=output.prompt_logprobs[1:],
            cumulative_logprob=sum(
                lp[t].logprob for t, lp in zip(prompt[1:], output.prompt_logprobs[1:], strict=True)
            ),
        )
        check_logprobs(dataclasses.replace(output, outputs=[completion]), expected, TOP)
        reference = reference_logprobs(checkpoint, prompt, output.token_ids)
        check_logprobs(output, reference, 1)  # the generated tokens' too
    assert_idle(llm)


def test_sample_logprobs_build_each_dict_when_read_and_pickle_as_a_list():
    import pickle

    from jaxllm.outputs import Logprob, SampleLogprobs

    # rows: logprob, rank, 3 top ids, their logprobs (`sampler.token_logprobs`, 3 top tokens)
    rows = np.array(
        [[-0.5, 2, 7, 4, 9, -0.25, -0.5, -3.0], [-4.0, 5, 1, 2, 3, -0.125, -0.375, -0.75]],
        np.float32,
    )
    asked: list[list[int]] = []

    def texts(ids):
        asked.append(ids)
        return {i: f"<{i}>" for i in ids}

    logprobs = SampleLogprobs([4, 8], rows, 2, texts)
    assert len(logprobs) == 2 and asked == []  # nothing built yet
    first = logprobs[0]
    assert first == {7: Logprob(-0.25, 1, "<7>"), 4: Logprob(-0.5, 2, "<4>")}
    assert logprobs[0] is first and len(asked) == 1  # built once
    assert list(first) == [4, 7] and list(logprobs[1]) == [8, 1, 2]  # the sampled token first
    assert logprobs[-1] == {1: (-0.125, 1, "<1>"), 2: (-0.375, 2, "<2>"), 8: (-4.0, 5, "<8>")}
    assert logprobs[:] == list(logprobs) == logprobs
    with pytest.raises(IndexError):
        logprobs[2]
    assert pickle.loads(pickle.dumps(logprobs)) == list(logprobs)


def test_processed_logprobs_are_of_the_logits_sampled_from(make_llm, checkpoint, greedy_prompts):
    """logprobs_mode="processed_logprobs": log-softmax after the repetition penalty, the
    temperature and top-k (the tokens top-k removes at -inf), as a numpy reference computes
    from transformers' logits; a greedy row's are of its penalized logits."""
    llm = make_llm(logprobs_mode="processed_logprobs")
    temperature, top_k, penalty = 0.7, 4, 1.3
    sampled = SamplingParams(
        temperature=temperature, top_k=top_k, repetition_penalty=penalty, max_tokens=6,
        logprobs=TOP, seed=5, ignore_eos=True,
    )  # fmt: skip
    greedy = greedy_params(6, logprobs=TOP, repetition_penalty=penalty)
    prompts = greedy_prompts[3:5]
    for params, scale, keep in ((sampled, temperature, top_k), (greedy, 1.0, None)):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            (completion,) = output.outputs
            for step, (token, entries) in enumerate(
                zip(completion.token_ids, completion.logprobs, strict=True)
            ):
                seen = set(prompt) | set(completion.token_ids[:step])
                logits = checkpoint.last_logits(prompt + completion.token_ids[:step])
                for t in seen:
                    logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
                logits = logits / scale
                if keep is not None:
                    logits[logits < np.sort(logits)[-keep]] = -np.inf
                expected = logits - np.logaddexp.reduce(logits[np.isfinite(logits)])
                assert entries[token].logprob == pytest.approx(expected[token], abs=1e-4)
                for i, entry in entries.items():
                    assert entry.logprob == pytest.approx(expected[i], abs=1e-4)
                if keep is not None:  # the top entries past top-k are removed tokens
                    assert sum(np.isfinite(e.logprob) for e in entries.values()) == keep


def test_prompt_logprobs_stay_raw_in_processed_mode(make_llm, greedy_prompts):
    """Prompt logprobs are raw in either mode: the rows that end a chunk of the prompt, which
    sample nothing, skip the request's logits processors, temperature and filters."""
    llm = make_llm(logprobs_mode="processed_logprobs")
    prompt = greedy_prompts[7]  # 100 tokens: in several chunks
    assert len(prompt) > llm.engine.scheduler.ladder.all_rows_tokens
    bias = dict.fromkeys(prompt, -30.0)
    plain, *processed = llm.generate(
        [prompt] * 3,
        [
            greedy_params(2, prompt_logprobs=1),
            greedy_params(2, prompt_logprobs=1, logit_bias=bias),
            SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0.5, top_k=3, seed=0),
        ],
        use_tqdm=False,
    )
    for output in processed:
        rows = zip(prompt[1:], plain.prompt_logprobs[1:], output.prompt_logprobs[1:], strict=True)
        for token, raw, got in rows:
            assert got[token].logprob == pytest.approx(raw[token].logprob, abs=1e-5)
            assert got[token].rank == raw[token].rank
    assert_idle(llm)
