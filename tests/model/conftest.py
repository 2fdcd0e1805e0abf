"""Fixtures of the model tests."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def exact_float32_matmuls():
    """GPUs default to TF32 for float32 matmuls (~1e-3 relative error); CPUs are exact anyway.

    Modules that compare float32 numerics ask for it with
    `pytestmark = pytest.mark.usefixtures("exact_float32_matmuls")`."""
    with jax.default_matmul_precision("highest"):
        yield
