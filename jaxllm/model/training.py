"""Per-token logprobs of whole sequences, for training loops (RL, distillation): the engine's own
forward pass over a paged cache made for the call, differentiable in the params.

The sequences of a batch are laid out as the engine lays out prefill chunks (`model/inputs.py`):
each padded at the front to whole tiles, its tokens written to blocks of its own, every row's
logits returned. With the portable attention every operation has a gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.attention import PORTABLE
from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs, fill_chunks
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.qwen3 import Params, forward

TILE = 16
BLOCK_SIZE = 16


def sequence_logprobs(params: Params, config: Qwen3Config, token_ids: jax.Array) -> jax.Array:
    """[B, L - 1] float32: log p(token_ids[b, t + 1] | token_ids[b, : t + 1]) under `params`,
    computed as the engine computes logits; jittable, and differentiable in `params`.

    Args:
        params: a param tree like `LLM.params` (on one device).
        token_ids: [B, L] token ids, each row a whole sequence (prompt and completion); the
            shape is static, the values may be traced.
    """
    num_seqs, length = token_ids.shape
    layout = _layout(num_seqs, length)
    rows = layout.sample_indices.reshape(num_seqs, length)
    ids = jnp.asarray(layout.token_ids).at[rows].set(jnp.asarray(token_ids, jnp.int32))
    inputs = layout._replace(token_ids=ids)
    num_blocks = num_seqs * -(-length // BLOCK_SIZE)
    kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE)
    logits, _ = forward(params, config, kv_cache, inputs, PORTABLE)  # [B * L, V]
    logits = logits.reshape(num_seqs, length, -1)[:, :-1]
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    targets = jnp.asarray(token_ids, jnp.int32)[:, 1:, None]
    return jnp.take_along_axis(logprobs, targets, axis=-1)[..., 0]


def _layout(num_seqs: int, length: int) -> ModelInputs:
    """The inputs of B sequences of L tokens as one prefill step (numpy; token ids 0), each in
    blocks of its own, every real row sampled, in order."""
    padded, blocks_per_seq = -(-length // TILE) * TILE, -(-length // BLOCK_SIZE)
    inputs = ModelInputs.padding(
        num_seqs * padded, num_seqs * padded // TILE, num_seqs * length, blocks_per_seq
    )
    tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, -1)
    starts, counts = np.zeros(num_seqs, np.int64), np.full(num_seqs, length, np.int64)
    inputs.sample_indices[:] = fill_chunks(inputs, tables, starts, counts, BLOCK_SIZE)
    return inputs
