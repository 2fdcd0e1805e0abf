"""The training forward (`model/training.py`): per-token logprobs of whole sequences equal the
engine's logprobs of the same sampled tokens (float32, CPU) and transformers' log-softmax, and
`jax.grad` goes through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxllm import SamplingParams
from jaxllm.model.training import sequence_logprobs

NUM_TOKENS = 20  # more than one tile (16) of output after prompts of 5 and 30 tokens


def test_sequence_logprobs_equal_the_engines_and_transformers(llm, checkpoint):
    prompts = [[5, 6, 7, 8, 9], list(range(40, 70))]
    params = SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, logprobs=0, seed=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        tokens = np.array([prompt + completion.token_ids])
        logprobs = np.asarray(
            jax.jit(sequence_logprobs, static_argnums=1)(llm.params, llm.model_config, tokens)
        )[0]
        assert logprobs.shape == (len(prompt) + NUM_TOKENS - 1,)
        pairs = zip(completion.token_ids, completion.logprobs, strict=True)
        engine = [entries[token].logprob for token, entries in pairs]
        np.testing.assert_allclose(logprobs[len(prompt) - 1 :], engine, atol=1e-5)
        with torch.no_grad():
            reference = checkpoint.torch_model(torch.tensor(tokens)).logits[0, :-1].double()
        reference = torch.log_softmax(reference, -1)[torch.arange(len(logprobs)), tokens[0, 1:]]
        np.testing.assert_allclose(logprobs, reference.numpy(), atol=1e-4)


def test_a_batch_gives_each_rows_logprobs_and_a_gradient(llm):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, llm.model_config.vocab_size, (3, 21))
    batch = sequence_logprobs(llm.params, llm.model_config, tokens)
    for row in range(3):
        alone = sequence_logprobs(llm.params, llm.model_config, tokens[row : row + 1])
        np.testing.assert_allclose(batch[row], alone[0], rtol=1e-6, atol=1e-5)

    loss = lambda params: -sequence_logprobs(params, llm.model_config, tokens).mean()
    grads = jax.grad(loss)(llm.params)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(llm.params))
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in leaves)
    assert all(float(jnp.abs(leaf).max()) > 0 for leaf in leaves)
    step = jax.tree.map(lambda p, g: p - 0.1 * g, llm.params, grads)
    assert float(loss(step)) < float(loss(llm.params))  # a step downhill lowers the loss
