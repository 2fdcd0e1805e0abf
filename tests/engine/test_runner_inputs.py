"""A step's host arrays packed into one int32 array per executable, and cut apart on the device."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.sched import Bucket
from jaxllm.steps import pack, unpack


def randomized(rng, arrays) -> list[np.ndarray]:
    """Arrays of the shapes and dtypes of `arrays`, with random bits (sign bits included)."""
    out = []
    for array in arrays:
        if array.dtype == np.float32:
            out.append(rng.standard_normal(array.shape).astype(np.float32))
        else:
            info = np.iinfo(array.dtype)
            out.append(rng.integers(info.min, info.max, array.shape).astype(array.dtype))
    return out


@pytest.mark.parametrize("which", [0, 1], ids=["model", "sampling"])
def test_unpack_returns_the_packed_arrays_bit_for_bit(which):
    like = Bucket("prefill", 48, 3, 3, 4).padding()[which]
    arrays = randomized(np.random.default_rng(0), like)
    packed = pack(arrays)

    assert packed.dtype == np.int32 and packed.ndim == 1
    unpacked = jax.jit(lambda p: unpack(p, like))(packed)
    for array, out in zip(arrays, unpacked, strict=True):
        out = np.asarray(out)
        assert out.dtype == array.dtype and out.shape == array.shape
        np.testing.assert_array_equal(out.view(np.int32), array.view(np.int32))


def test_pack_refuses_an_array_that_is_not_four_bytes_wide():
    _, sampling = Bucket("decode", 4, 4, 4, 1).padding()
    with pytest.raises(ValueError, match=r"array 0 is float64"):
        pack(sampling._replace(temperature=sampling.temperature.astype(np.float64)))
