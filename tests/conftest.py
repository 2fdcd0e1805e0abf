"""Test-wide settings: emulated CPU devices for tensor parallelism, and the `gpu` marker."""

import os

# NOTE: must happen before jax is imported anywhere; harmless on GPU machines (host platform only).
# Eight emulated devices: enough for TP=8 (tests/engine/test_tp.py).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def _has_gpu() -> bool:
    import jax

    return any(d.platform == "gpu" for d in jax.devices())


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items) or _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
