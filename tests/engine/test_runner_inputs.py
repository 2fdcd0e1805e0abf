"""A step's host arrays packed into one int32 array per executable, and cut apart on the device."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.runner import model_layout, pack, sampling_layout, unpack
from jaxllm.sched.batch import BucketShape


def random_arrays(rng, layout) -> dict[str, np.ndarray]:
    arrays = {}
    for name, shape, dtype in layout:
        if np.dtype(dtype) == np.float32:
            arrays[name] = rng.standard_normal(shape).astype(np.float32)
        else:  # int32 and uint32 over their whole ranges, sign bits included
            info = np.iinfo(dtype)
            arrays[name] = rng.integers(info.min, info.max, shape, dtype=np.int64).astype(dtype)
    return arrays


@pytest.mark.parametrize(
    "layout",
    [model_layout(BucketShape("prefill", 48, 3, 3, 4)), sampling_layout(7)],
    ids=["model", "sampling"],
)
def test_unpack_returns_the_packed_arrays_bit_for_bit(layout):
    arrays = random_arrays(np.random.default_rng(0), layout)
    packed = pack(layout, arrays)

    assert packed.dtype == np.int32 and packed.ndim == 1
    unpacked = jax.jit(lambda p: unpack(layout, p))(packed)
    for name, shape, dtype in layout:
        array, out = arrays[name], np.asarray(unpacked[name])
        assert out.dtype == dtype and out.shape == shape, name
        np.testing.assert_array_equal(out.view(np.int32), array.view(np.int32), err_msg=name)


def test_pack_names_an_array_of_the_wrong_dtype_or_shape_or_a_wrong_name():
    layout = sampling_layout(4)
    arrays = random_arrays(np.random.default_rng(1), layout)
    with pytest.raises(ValueError, match=r"temperature: float64\[4\], not float32\[4\]"):
        pack(layout, arrays | {"temperature": arrays["temperature"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"steps: int32\[3\]"):
        pack(layout, arrays | {"steps": arrays["steps"][:3]})
    with pytest.raises(ValueError, match=r"not the layout's"):
        pack(layout, arrays | {"sample_steps": arrays["steps"]})
