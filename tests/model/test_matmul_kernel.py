"""jaxllm's Pallas matmul of a few rows against jnp.dot: in float32 through Pallas' interpreter
on any machine, inside a decode step, and compiled (Triton) in bf16 on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.inputs import decode_step_case, relative_error, small_config

from jaxllm.model.attention import Kernels
from jaxllm.model.matmul_kernel import MAX_ROWS, small_matmul, splits_for
from jaxllm.model.qwen3 import forward


def test_splits_fill_the_gpu_with_whole_blocks_of_inputs():
    assert splits_for(1024, 4096) == 1  # 128 programs of 32 columns already
    assert splits_for(2048, 1024) == 4
    assert splits_for(3072, 1024) == 4  # 768 inputs a program: 6 blocks of 128
    assert splits_for(384, 32) == 1  # no power of two >1 splits 384 into blocks of 128
    assert splits_for(1024, 48) is None  # columns not in blocks of 32
    assert splits_for(100, 64) is None  # inputs not in blocks of 128


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 256, 128), (5, 512, 64), (MAX_ROWS, 384, 96), (3, 128, 4096),
])  # fmt: skip
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpreted_kernel_equals_jnp_dot(rows, in_features, out_features, dtype):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, in_features)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((in_features, out_features)), jnp.float32)

    got = small_matmul(x, w, out_dtype=jnp.dtype(dtype), interpret=True)

    assert got.shape == (rows, out_features) and got.dtype == jnp.dtype(dtype)
    expected = jnp.dot(x, w, precision="highest")
    assert relative_error(got, expected) <= (1e-6 if dtype == "float32" else 4e-3)


def test_too_many_rows_or_an_odd_shape_is_refused():
    with pytest.raises(ValueError, match=f"no small matmul of {MAX_ROWS + 1} rows"):
        small_matmul(jnp.zeros((MAX_ROWS + 1, 128)), jnp.zeros((128, 32)), out_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"\[100, 32\]"):
        small_matmul(jnp.zeros((2, 100)), jnp.zeros((100, 32)), out_dtype=jnp.float32)


def test_small_decode_steps_take_the_kernel_and_agree():
    """With `small_matmul_rows`, a decode step's projections run the kernel (interpreted here)
    and give the logits and cache of the step on jnp.dot; a prefill of more rows does not."""
    config = small_config(
        hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32
    )
    params, cache, decode, prefill = decode_step_case(config, with_prefill=True)
    small = Kernels(decode="pallas", interpret=True, small_matmul_rows=MAX_ROWS)
    without = Kernels(decode="pallas", interpret=True)

    def jaxpr(inputs, kernels) -> str:
        make = jax.make_jaxpr(forward, static_argnums=(1, 4))
        return str(make(params, config, cache, inputs, kernels))

    assert "jaxllm_small_matmul" in jaxpr(decode, small)
    assert "jaxllm_small_matmul" not in jaxpr(decode, without)
    assert "jaxllm_small_matmul" not in jaxpr(prefill, small)  # 56 rows
    step = jax.jit(forward, static_argnums=(1, 4))
    logits, with_kernel = step(params, config, cache, decode, small)
    expected_logits, expected = step(params, config, cache, decode, without)
    assert relative_error(logits, expected_logits) <= 1e-5
    assert relative_error(with_kernel.keys, expected.keys) <= 1e-6


@pytest.mark.gpu
def test_compiled_kernel_equals_jnp_dot_in_bfloat16():
    """On a GPU: the Triton kernel at qwen3-0.6b's projections, 1, 8 and 32 rows."""
    rng = np.random.default_rng(3)
    for rows in (1, 8, MAX_ROWS):
        for in_features, out_features in ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)):
            x = jnp.asarray(rng.standard_normal((rows, in_features)), jnp.bfloat16)
            w = jnp.asarray(rng.standard_normal((in_features, out_features)) * 0.03, jnp.bfloat16)
            expected = jnp.dot(x, w, preferred_element_type=jnp.float32)

            got = small_matmul(x, w, out_dtype=jnp.float32)

            assert relative_error(got, expected) <= 1e-3
