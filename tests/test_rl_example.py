"""The RL example (`examples/rl_loop.py`): its advantages are per-group z-scores, and a few
training steps give finite losses, new params, and an engine that samples with them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.model.training import sequence_logprobs

EXAMPLE = Path(__file__).parents[1] / "examples" / "rl_loop.py"
# A smaller step than the example's, for a 2-core CPU.
SETTINGS = dict(num_prompts=2, prompt_length=8, group_size=4, max_tokens=8)
NUM_STEPS = 3
NUM_GREEDY_TOKENS = 8


@pytest.fixture(scope="module")
def rl_loop():
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rl_loop"] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["rl_loop"]


def test_rewards_and_advantages(rl_loop):
    limit = rl_loop.TARGET_ID_LIMIT
    assert rl_loop.reward([0, limit - 1, limit, limit + 5]) == 0.5
    rewards = np.array([[0.0, 0.5, 1.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    advantages = rl_loop.group_advantages(rewards)
    np.testing.assert_allclose(advantages.mean(axis=1), 0.0, atol=1e-12)
    np.testing.assert_allclose(advantages[0], [-np.sqrt(2), 0.0, np.sqrt(2), 0.0], rtol=1e-5)
    np.testing.assert_array_equal(advantages[1], 0.0)  # a group of equal rewards teaches nothing


def test_training_steps_change_the_weights_the_engine_samples_with(rl_loop):
    settings = rl_loop.RLSettings(**SETTINGS)
    llm = rl_loop.make_llm(settings)
    prompts = rl_loop.make_prompts(settings, llm.model_config.vocab_size)
    greedy = SamplingParams(
        temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True, logprobs=0
    )
    before = llm.generate(prompts, greedy, use_tqdm=False)
    initial = [np.array(leaf) for leaf in jax.tree.leaves(llm.params)]

    results = rl_loop.train(llm, NUM_STEPS, settings, log=lambda line: None)

    assert [result.step for result in results] == list(range(NUM_STEPS))
    assert all(np.isfinite(result.loss) for result in results)
    assert all(0.0 <= result.mean_reward <= 1.0 for result in results)
    trained = jax.tree.leaves(llm.params)
    assert all(
        not np.array_equal(old, np.asarray(new)) for old, new in zip(initial, trained, strict=True)
    )

    after = llm.generate(prompts, greedy, use_tqdm=False)
    assert any(
        old.outputs[0].token_ids != new.outputs[0].token_ids
        for old, new in zip(before, after, strict=True)
    )
    # The engine's logprobs of its greedy tokens are those of the trained params.
    pairs = zip(prompts, after, strict=True)
    tokens = np.array([prompt + output.outputs[0].token_ids for prompt, output in pairs])
    expected = np.asarray(sequence_logprobs(llm.params, llm.model_config, tokens))
    for row, output in enumerate(after):
        completion = output.outputs[0]
        engine = [
            entries[token].logprob
            for token, entries in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        np.testing.assert_allclose(expected[row, settings.prompt_length - 1 :], engine, atol=1e-5)
