"""How far bf16 logits are from float32's, and two attention kernels' bf16 logits from each other.

Random weights of a preset's shape (qwen3-0.6b by default) at a number of layers, four prompts
of up to 700 tokens prefilled at once, on any machine (the portable backend). The second
"kernel" is the portable one computing in float32 and rounding once: the same maths
rounded differently, as another attention kernel would be. Relative errors (L2) of the
sampled rows' logits:

    python scripts/bf16_noise.py --layers 4 28
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model import attention
from jaxllm.model.config import PRESETS
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.qwen3 import forward, init_params
from jaxllm.research.flags import at_least

BLOCK_SIZE, TILE = 256, 128


REFERENCE = attention.reference_attention


def reference_f32_probs(q, k_cache, v_cache, inputs):
    """The portable attention computing in float32 throughout, rounded once at the end."""
    f32 = jnp.float32
    out = REFERENCE(q.astype(f32), k_cache.astype(f32), v_cache.astype(f32), inputs)
    return out.astype(q.dtype)


def prefill_inputs(rng: np.random.Generator, num_prompts: int, max_len: int) -> ModelInputs:
    """Prompts of random lengths, each front-padded to whole tiles, in scattered blocks."""
    blocks = rng.permutation(num_prompts * -(-max_len // BLOCK_SIZE)).tolist()
    width = -(-max_len // BLOCK_SIZE)
    ids, positions, slots, tables, lens, samples = [], [], [], [], [], []
    for _ in range(num_prompts):
        n = int(rng.integers(1, max_len + 1))
        table, blocks = blocks[:width], blocks[width:]
        pad = -n % TILE
        ids += [0] * pad + rng.integers(0, 1000, n).tolist()
        positions += [0] * pad + list(range(n))
        slots += [-1] * pad + [
            table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)
        ]
        for tile in range((pad + n) // TILE):
            tables.append(table)
            lens.append((tile + 1) * TILE - pad)
        samples.append(len(ids) - 1)
    as_array = lambda values: jnp.asarray(np.array(values, np.int32))
    return ModelInputs(*map(as_array, (ids, positions, slots, tables, lens, samples)))


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=at_least(1), nargs="+", default=[4, 28])
    args = parser.parse_args()
    for num_layers in args.layers:
        config = PRESETS[args.model].replace(num_layers=num_layers, dtype="bfloat16")
        params = init_params(config, seed=0)
        inputs = prefill_inputs(np.random.default_rng(1), 4, 700)
        num_blocks = int(inputs.block_tables.max()) + 1
        runs = {
            "float32": (
                config.replace(dtype="float32"),
                jax.tree.map(lambda x: x.astype(jnp.float32), params),
                REFERENCE,
            ),
            "reference": (config, params, REFERENCE),
            "other kernel": (config, params, reference_f32_probs),
        }
        logits = {}
        for name, (model, weights, kernel) in runs.items():
            cache = allocate_kv_cache(model, num_blocks, BLOCK_SIZE)
            # NOTE: "another kernel" stands in for the portable attention; a fresh function, so
            # jax traces it anew.
            with mock.patch.object(attention, "reference_attention", kernel):
                step = jax.jit(lambda *args: forward(*args), static_argnums=1)
                logits[name] = np.asarray(step(weights, model, cache, inputs)[0])
        print(
            f"{args.model}, {num_layers} layers: bf16 vs float32 "
            f"{relative_error(logits['reference'], logits['float32']):.3g}, two kernels "
            f"{relative_error(logits['other kernel'], logits['reference']):.3g}"
        )


if __name__ == "__main__":
    main()
