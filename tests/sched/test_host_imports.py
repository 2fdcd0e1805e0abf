"""The host side runs without a model: importing it must not import jax or flax."""

from __future__ import annotations

from support.repo import assert_import_leaves_out


def test_cache_and_sched_import_no_jax():
    assert_import_leaves_out("jaxllm.cache, jaxllm.sched", {"jax", "flax"})
