"""Sampling through the whole engine: the first token's empirical distribution over 2,000 seeds
matches the exact one computed from transformers' logits, and seeds make requests reproducible
whatever else is in the batch."""

from __future__ import annotations

import numpy as np
import pytest
from support.engine import BASE_SETTINGS, assert_idle, gpu_kernel_settings, make_llm_with
from support.hf import VOCAB_SIZE
from support.sampling import assert_matches, exact_distribution

from jaxllm import LLM, SamplingParams

NUM_SEEDS = 2000
TEMPERATURE = 0.4


def midpoint_settings(logits) -> dict[str, dict]:
    """Filter settings, each keeping a different number of tokens, whose boundaries sit in wide
    gaps between two tokens, far from any rounding difference between jaxllm's and transformers'
    logits."""
    scaled = np.sort(np.asarray(logits) / TEMPERATURE)[::-1]
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    gaps = -np.diff(scaled)

    def last_kept(low: int, high: int) -> int:
        """The index in [low, high) of the widest gap after it: the last token a filter keeps."""
        index = low + int(np.argmax(gaps[low:high]))
        assert gaps[index] > 1e-3
        return index

    k, p, m, kp = last_kept(1, 4), last_kept(4, 8), last_kept(8, 14), last_kept(9, 16)
    return {
        "temperature": {},
        "top_k": {"top_k": k + 1},
        "top_p": {"top_p": float((cumulative[p - 1] + cumulative[p]) / 2)},
        "min_p": {"min_p": float((probs[m] + probs[m + 1]) / 2 / probs[0])},
        # Top-p over the top-(kp + 1) distribution keeps kp tokens (over the full one: fewer).
        "top_k_top_p": {
            "top_k": kp + 1,
            "top_p": float((cumulative[kp - 2] + cumulative[kp - 1]) / 2 / cumulative[kp]),
        },
    }


@pytest.fixture(scope="module")
def first_tokens(llm, checkpoint):
    """For each filter: its settings, the exact distribution and 2,000 seeded first tokens."""
    prompt = np.random.default_rng(3).integers(0, VOCAB_SIZE, 20).tolist()
    logits = checkpoint.last_logits(prompt)
    settings = midpoint_settings(logits)
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=1, seed=index * NUM_SEEDS + i, **filters)
        for index, filters in enumerate(settings.values())
        for i in range(NUM_SEEDS)
    ]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert_idle(llm)
    tokens = np.array([o.token_ids for o in outputs]).reshape(len(settings), NUM_SEEDS)
    return {
        name: (filters, exact_distribution(logits, TEMPERATURE, **filters), tokens[index])
        for index, (name, filters) in enumerate(settings.items())
    }


@pytest.mark.parametrize("name", ["temperature", "top_k", "top_p", "min_p", "top_k_top_p"])
def test_first_token_distribution(first_tokens, name):
    filters, expected, tokens = first_tokens[name]
    if name != "temperature":
        assert 2 <= np.count_nonzero(expected) <= 16, filters

    assert_matches(tokens, expected)


def test_seeded_requests_ignore_the_steps_per_plan(make_llm):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB_SIZE, n).tolist() for n in (3, 40, 17)]
    params = [
        SamplingParams(temperature=t, top_k=k, max_tokens=19, seed=s, ignore_eos=True)
        for t, k, s in ((1.0, 0, 7), (0.7, 20, 2**40 + 3), (1.3, 5, 11))
    ]
    one, five = (
        make_llm(num_scheduler_steps=n).generate(prompts, params, use_tqdm=False) for n in (1, 5)
    )
    assert [o.token_ids for o in one] == [o.token_ids for o in five]


def test_seeded_requests_ignore_where_the_sampler_reads_its_settings(make_llm, checkpoint):
    """With the kernels' `fixed_inputs` (NVIDIA GPUs) the sampler reads its rows' settings
    from the buffers `FixedInputs` writes with the forward pass's inputs, not from a host
    array of its own: the same draws, row for row, step by step."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, VOCAB_SIZE, n).tolist() for n in (3, 40, 17)]
    params = [
        SamplingParams(temperature=t, top_k=k, max_tokens=13, seed=s, ignore_eos=True)
        for t, k, s in ((1.0, 0, 7), (0.7, 20, 2**40 + 3), (1.3, 5, 11))
    ]
    with gpu_kernel_settings(fixed_inputs=True):
        fixed_llm = make_llm_with(checkpoint.path, **BASE_SETTINGS)  # not shared
    host_llm = make_llm()
    assert fixed_llm.engine.runner._fixed.enabled and not host_llm.engine.runner._fixed.enabled

    fixed_outputs, host_outputs = (
        llm.generate(prompts, params, use_tqdm=False) for llm in (fixed_llm, host_llm)
    )
    assert [o.token_ids for o in fixed_outputs] == [o.token_ids for o in host_outputs]
    assert len({tuple(o.token_ids) for o in fixed_outputs}) == 3


def test_seeded_request_ignores_its_batch(llm):
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, VOCAB_SIZE, 37).tolist()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    others = [rng.integers(0, VOCAB_SIZE, n).tolist() for n in (5, 80, 1, 140, 19)]
    other_params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)

    (alone,) = llm.generate([prompt], seeded, use_tqdm=False)
    batch = llm.generate(
        [*others[:3], prompt, *others[3:]],
        [*[other_params] * 3, seeded, *[other_params] * 2],
        use_tqdm=False,
    )
    assert batch[3].token_ids == alone.token_ids
    assert len(alone.token_ids) == 16
    # Unseeded requests draw streams of their own: not all equal to each other.
    unseeded = llm.generate([prompt] * 4, other_params, use_tqdm=False)
    assert len({tuple(o.token_ids) for o in unseeded}) > 1


def test_engine_seed_makes_unseeded_requests_reproducible(checkpoint):
    prompt = list(range(30))
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = [
        LLM(str(checkpoint.path), **(BASE_SETTINGS | {"seed": 5})).generate(
            [prompt] * 3, params, use_tqdm=False
        )
        for _ in range(2)
    ]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert len({tuple(o.token_ids) for o in runs[0]}) == 3
