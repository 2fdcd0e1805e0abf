"""The fast backends ("flash": FlashAttention-3; "pallas": jaxllm's decode kernel) against
the portable reference, on a GPU.

Skipped on CPU (`gpu` marker); run on the H200 with `python -m pytest -q -m gpu tests`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import Chunk, build_inputs, relative_error

from jaxllm.model import flash_attention
from jaxllm.model.attention import Kernels, reference_attention
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.qwen3 import COMPILER_OPTIONS, forward

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 256
# The kernels of each backend name (prefill, decode), as the platform module picks them.
KERNELS = {
    "reference": Kernels(),
    "flash": Kernels("flash", "flash"),
    "pallas": Kernels("flash" if flash_attention.installed() else "reference", "pallas"),
}


def random_chunks(rng, count: int, max_start: int, max_new: int, num_blocks: int, room: int = 0):
    """Chunks over random, scattered block tables: `start` cached tokens plus new ones (and
    blocks for `room` more tokens)."""
    blocks = rng.permutation(num_blocks).tolist()
    chunks = []
    for _ in range(count):
        start = int(rng.integers(0, max_start + 1))
        new = int(rng.integers(1, max_new + 1))
        needed = -(-(start + new + room) // BLOCK_SIZE)
        table, blocks = blocks[:needed], blocks[needed:]
        chunks.append(Chunk(rng.integers(0, 1000, new).tolist(), start, table))
    return chunks


@pytest.mark.parametrize(
    ("tile_size", "count", "max_start", "max_new"),
    [(1, 64, 2000, 1), (128, 8, 1500, 600)],
    ids=["decode", "prefill-over-cached-context"],
)
def test_flash_matches_reference_attention(tile_size, count, max_start, max_new):
    if not flash_attention.installed():
        pytest.skip("flash-attn3-jax is not installed")
    rng = np.random.default_rng(0)
    num_blocks = 1024
    chunks = random_chunks(rng, count, max_start, max_new, num_blocks)
    inputs = build_inputs(chunks, BLOCK_SIZE, tile_size, table_width=16)
    num_heads, num_kv_heads, head_dim = 16, 8, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (inputs.token_ids.shape[0], num_heads, head_dim), jnp.bfloat16)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = jax.random.normal(keys[1], shape, jnp.bfloat16)
    v_cache = jax.random.normal(keys[2], shape, jnp.bfloat16)

    flash = jax.jit(flash_attention.flash_attention)(q, k_cache, v_cache, inputs)
    reference = jax.jit(reference_attention)(q, k_cache, v_cache, inputs)

    real_rows = np.asarray(inputs.slot_mapping) >= 0
    flash, reference = np.asarray(flash)[real_rows], np.asarray(reference)[real_rows]
    row_errors = [relative_error(f, r) for f, r in zip(flash, reference, strict=True)]
    worst = int(np.argmax(row_errors))
    assert relative_error(flash, reference) < 1e-2, (
        f"worst row {worst}: error {row_errors[worst]:.3g}, "
        f"context {np.asarray(inputs.context_lens)[worst]}, errors {np.round(row_errors, 4)}"
    )


def skip_unless_runs(backend: str) -> None:
    if backend == "flash" and not flash_attention.installed():
        pytest.skip("flash-attn3-jax is not installed")


@pytest.mark.parametrize("backend", ["flash", "pallas"])
@pytest.mark.parametrize("num_layers", [4, 28])
def test_fast_model_logits_match_reference_in_bfloat16(num_layers, backend):
    """Logits of the qwen3-0.6b shape (random weights, bf16): a fast backend ("flash", or
    "pallas": jaxllm's decode kernel, prefill on FA3) vs the portable backend.

    The fast logits are within 1e-2 (relative) of the portable ones, and as close to the float32
    logits of the same weights as the portable bf16 path is.
    """
    from jaxllm.model.config import PRESETS
    from jaxllm.model.qwen3 import init_params

    skip_unless_runs(backend)
    config = PRESETS["qwen3-0.6b"].replace(num_layers=num_layers, dtype="bfloat16")
    params = init_params(config, seed=0)
    rng = np.random.default_rng(1)
    num_blocks = 64
    prompts = random_chunks(rng, 4, 0, 700, num_blocks)
    prompts = [Chunk(c.token_ids, 0, c.block_table) for c in prompts]
    prefill = build_inputs(prompts, BLOCK_SIZE, 128, table_width=8, sample_all=False)
    step = jax.jit(forward, static_argnums=(1, 4), donate_argnums=2)

    params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    logits = {}
    for run in ("reference", backend, "float32"):
        model, weights, kernels = config, params, KERNELS.get(run, Kernels())
        if run == "float32":
            model, weights = config.replace(dtype="float32"), params32
        cache = allocate_kv_cache(model, num_blocks, BLOCK_SIZE)
        # NOTE: float32 means float32 on a GPU, not TF32; the bf16 runs keep the default.
        precision = "highest" if run == "float32" else None
        with jax.default_matmul_precision(precision):
            prefill_logits, cache = step(weights, model, cache, prefill, kernels)
        # One decode step on top of the prefilled prompts (the same tokens for every run).
        tokens = [c.token_ids[0] for c in prompts]
        decode = build_inputs(
            [
                Chunk([int(t)], len(c.token_ids), c.block_table)
                for c, t in zip(prompts, tokens, strict=True)
            ],
            BLOCK_SIZE,
            1,
            table_width=8,
        )
        with jax.default_matmul_precision(precision):
            decode_logits, cache = step(weights, model, cache, decode, kernels)
        logits[run] = (np.asarray(prefill_logits), np.asarray(decode_logits))

    def errors(a: str, b: str) -> list[float]:
        return [relative_error(x, y) for x, y in zip(logits[a], logits[b], strict=True)]

    fast_vs_reference = errors(backend, "reference")
    fast_vs_f32, reference_vs_f32 = errors(backend, "float32"), errors("reference", "float32")
    report = f"{backend}-ref {fast_vs_reference}, {backend}-f32 {fast_vs_f32}, "
    report += f"ref-f32 {reference_vs_f32}"
    print(f"{num_layers} layers: {report}")
    assert max(fast_vs_reference) <= 1e-2, report
    for fast, reference in zip(fast_vs_f32, reference_vs_f32, strict=True):
        assert fast < 1.25 * reference, report


@pytest.mark.parametrize("backend", ["flash", "pallas"])
def test_fast_greedy_tokens_agree_until_a_bf16_near_tie(backend):
    """Greedy decoding of the qwen3-0.6b shape (random bf16 weights) with each backend: the
    tokens agree with the portable backend's until the first step where the latter's own top
    two logits are within bf16 noise of each other (then either choice is right)."""
    from jaxllm.model.config import PRESETS
    from jaxllm.model.qwen3 import init_params

    skip_unless_runs(backend)
    config = PRESETS["qwen3-0.6b"].replace(dtype="bfloat16")
    params = init_params(config, seed=0)
    rng = np.random.default_rng(2)
    num_blocks, num_steps = 64, 32
    prompts = [
        Chunk(c.token_ids, 0, c.block_table)
        for c in random_chunks(rng, 8, 0, 400, num_blocks, room=num_steps)
    ]
    step = jax.jit(
        forward, static_argnums=(1, 4), donate_argnums=2, compiler_options=COMPILER_OPTIONS
    )

    def greedy(run: str, params) -> tuple[np.ndarray, np.ndarray]:
        """[steps, prompts] tokens and [steps, prompts, V] logits of greedy decoding."""
        cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE)
        inputs = build_inputs(prompts, BLOCK_SIZE, 128, table_width=8, sample_all=False)
        tokens, all_logits = [], []
        lengths = [len(c.token_ids) for c in prompts]
        for _ in range(num_steps):
            logits, cache = step(params, config, cache, inputs, KERNELS[run])
            logits = np.asarray(logits, np.float32)
            chosen = logits.argmax(axis=-1)
            tokens.append(chosen)
            all_logits.append(logits)
            inputs = build_inputs(
                [
                    Chunk([int(t)], n, c.block_table)
                    for c, t, n in zip(prompts, chosen, lengths, strict=True)
                ],
                BLOCK_SIZE,
                1,
                table_width=8,
            )
            lengths = [n + 1 for n in lengths]
        return np.stack(tokens), np.stack(all_logits)

    reference_tokens, reference_logits = greedy("reference", params)
    fast_tokens, _ = greedy(backend, params)
    agreed = []
    for row in range(len(prompts)):
        differ = np.flatnonzero(reference_tokens[:, row] != fast_tokens[:, row])
        agreed.append(int(differ[0]) if len(differ) else num_steps)
        if len(differ):
            step_logits = reference_logits[differ[0], row]
            gap = (
                step_logits[reference_tokens[differ[0], row]]
                - step_logits[fast_tokens[differ[0], row]]
            )
            # NOTE: bf16 noise on logits of this size: ~1e-2 relative (see the test above).
            noise = 3e-2 * np.abs(step_logits).max()
            assert 0 <= gap < noise, f"prompt {row} diverged at step {differ[0]}: gap {gap:.4g}"
    print(f"steps of agreement per prompt (of {num_steps}): {agreed}")
    assert np.mean(agreed) >= num_steps / 4, agreed
