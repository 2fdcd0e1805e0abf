"""The q/k norm, rotary and cache-write kernel (qkv_kernel.py) against the jax.numpy ops it
replaces: interpreted on any machine, compiled (Triton) on a GPU; and the model's decode steps
take it exactly where they should."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import Chunk, build_inputs, relative_error, small_config

from jaxllm.model.attention import Kernels
from jaxllm.model.config import Qwen3Config
from jaxllm.model.kv_cache import KVCache, allocate_kv_cache, write_kv
from jaxllm.model.layers import apply_rotary, rotary_cos_sin
from jaxllm.model.qkv_kernel import kernel_fits, norm_rope_write
from jaxllm.model.qwen3 import forward, init_params

EPS = 1e-6


def jnp_norm_rope_write(qkv, q_scale, k_scale, cos, sin, kv_cache, layer, slot_mapping):
    """The kernel's maths with the layer's jax.numpy ops, rounded once as the kernel does."""
    num_tokens, _, width, head_dim = qkv.shape

    def norm(x, scale):
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
        return x * scale.astype(jnp.float32)

    q = norm(qkv[:, :, : width - 2], q_scale).reshape(num_tokens, -1, head_dim)
    keys = norm(qkv[:, :, width - 2], k_scale)
    q, keys = apply_rotary(q, cos, sin), apply_rotary(keys, cos, sin)
    values = qkv[:, :, width - 1]
    kv_cache = write_kv(kv_cache, layer, keys.astype(qkv.dtype), values, slot_mapping)
    return q.astype(qkv.dtype), kv_cache


def random_case(rng, num_kv_heads, group, head_dim, dtype, num_tokens=8):
    """Projections, scales, rotary tables at scattered positions, a cache of noise, and slots
    with padding (-1) among them."""
    num_layers, block_size = 3, 16
    num_blocks = max(4, 2 * num_tokens // block_size)
    qkv = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, group + 2, head_dim)), dtype)
    q_scale, k_scale = (jnp.asarray(1 + 0.1 * rng.normal(size=head_dim), dtype) for _ in "qk")
    cos, sin = rotary_cos_sin(jnp.asarray(rng.integers(0, 4000, num_tokens)), head_dim, 1e6)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens]
    slots[1::3] = -1
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    cache = KVCache(*(jnp.asarray(rng.normal(size=shape), dtype) for _ in "kv"))
    return qkv, q_scale, k_scale, cos, sin, cache, jnp.asarray(slots, jnp.int32)


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "dtype"),
    [(8, 2, 128, "float32"), (8, 2, 128, "bfloat16"), (4, 4, 64, "float32"), (1, 8, 32, "float32")],
    ids=["qwen3-0.6b", "qwen3-0.6b-bf16", "qwen3-8b-tp2", "one-kv-head"],
)
def test_interpreted_kernel_equals_jax_numpy(num_kv_heads, group, head_dim, dtype):
    case = random_case(np.random.default_rng(0), num_kv_heads, group, head_dim, dtype)
    q_expected, cache_expected = jnp_norm_rope_write(*case[:6], 1, case[6])

    q, cache = norm_rope_write(*case[:6], 1, case[6], eps=EPS, interpret=True)

    # float32: the same sums in another order; bfloat16: an ulp where they round differently.
    tolerance = 1e-6 if dtype == "float32" else 1e-3
    assert relative_error(q, q_expected) <= tolerance
    assert relative_error(cache.keys, cache_expected.keys) <= tolerance
    # Values are copied; padding slots and every other slot of the cache are untouched.
    assert (np.asarray(cache.values) == np.asarray(cache_expected.values)).all()


def test_shapes_the_kernel_takes():
    assert kernel_fits(8, 2, 128) and kernel_fits(8, 4, 128) and kernel_fits(1, 8, 64)
    assert not kernel_fits(8, 5, 128)  # qwen3-14b: 40 query heads over 8 kv heads
    assert not kernel_fits(8, 2, 16)


def decode_step_case(config: Qwen3Config):
    """A prefilled cache and the inputs of one decode step of three sequences and one padding
    row, on a small random model."""
    params = init_params(config, seed=0)
    rng = np.random.default_rng(1)
    block_size, width = 16, 4
    cache = allocate_kv_cache(config, 16, block_size)
    prompts = [
        Chunk(rng.integers(0, 64, n).tolist(), 0, [3 * i, 3 * i + 1, 3 * i + 2])
        for i, n in enumerate((5, 17, 33))
    ]
    prefill = build_inputs(prompts, block_size, 8, width)
    _, cache = jax.jit(forward, static_argnums=1)(params, config, cache, prefill)
    decode = build_inputs(
        [Chunk([7], len(c.token_ids), c.block_table) for c in prompts], block_size, 1, width, 4
    )
    return params, cache, decode


def test_pallas_decode_steps_take_the_kernel_and_agree():
    """The "pallas" kernels' decode step runs the kernel (interpreted here) and gives the logits
    and cache of the portable step, which runs the jax.numpy ops."""
    config = small_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32)
    params, cache, decode = decode_step_case(config)
    pallas = Kernels(decode="pallas", interpret=True)

    def jaxpr(kernels) -> str:
        make = jax.make_jaxpr(forward, static_argnums=(1, 4))
        return str(make(params, config, cache, decode, kernels))

    assert "jaxllm_norm_rope_write" in jaxpr(pallas)
    assert "jaxllm_norm_rope_write" not in jaxpr(Kernels())
    step = jax.jit(forward, static_argnums=(1, 4))
    logits, with_kernel = step(params, config, cache, decode, pallas)
    expected_logits, expected = step(params, config, cache, decode, Kernels())
    assert relative_error(logits, expected_logits) <= 1e-5
    assert relative_error(with_kernel.keys, expected.keys) <= 1e-6
    assert relative_error(with_kernel.values, expected.values) <= 1e-6


@pytest.mark.gpu
def test_compiled_kernel_equals_jax_numpy_in_bfloat16():
    """On a GPU: the Triton kernel, at qwen3-0.6b's and qwen3-8b's head shapes, a decode
    batch of 256 with padding rows."""
    for num_kv_heads, group in ((8, 2), (8, 4)):
        rng = np.random.default_rng(2)
        case = random_case(rng, num_kv_heads, group, 128, "bfloat16", num_tokens=256)
        q_expected, cache_expected = jax.jit(jnp_norm_rope_write)(*case[:6], 2, case[6])

        q, cache = norm_rope_write(*case[:6], 2, case[6], eps=EPS)

        # One bf16 rounding of the same float32 value: equal up to an ulp where the kernel's
        # float32 sums differ in their last bits.
        assert relative_error(q, q_expected) <= 4e-3
        assert relative_error(cache.keys, cache_expected.keys) <= 4e-3
        assert (np.asarray(cache.values) == np.asarray(cache_expected.values)).all()
