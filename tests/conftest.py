"""Test-wide settings (emulated CPU devices for tensor parallelism, the `gpu` marker) and the
fixtures tests of any directory share: tiny random Qwen3 checkpoints written by transformers,
their greedy references, and a few session-scoped engines (compiled lazily, bucket by bucket).

Pytest puts `tests/` on sys.path for this file, so tests import helpers from `support`. The
fixtures import them (and so torch, transformers and jax) only when first used: the host-side
tests (`tests/sched`, `tests/cache`) load none of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import numpy as np
import pytest

# Eight emulated devices: enough for TP=8 (tests/engine/test_tp.py).
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
# XLA's quickest CPU compiles: the test models are tiny, so compiling is most of the suite's
# time. On 2 cores they take tests/engine/test_greedy.py's compiling from 41 s to 11 and the
# suite from 14.6 minutes to 11.3, though the text tests' 151,936-token vocabulary then runs
# slower. They are added only where this XLA knows them all (an unknown flag aborts the
# process), as a child process finds.
QUICK_CPU_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def _xla_flags() -> str:
    flags = " ".join((HOST_DEVICES_FLAG, *QUICK_CPU_COMPILE_FLAGS))
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
        capture_output=True,
    )
    return flags if probe.returncode == 0 else HOST_DEVICES_FLAG


# NOTE: must happen before jax is imported anywhere; harmless on GPU machines (host platform only).
# pytest-xdist's workers inherit the flags from the process that starts them.
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = _xla_flags()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if TYPE_CHECKING:
    from support.hf import Checkpoint, HFModel

    from jaxllm import LLM

# `hf_model`'s shapes: name -> random_qwen3's arguments, and the checkpoint's max shard size.
HF_MODEL_SHAPES = {
    "tied-mqa": dict(tied=True, num_heads=4, num_kv_heads=1, head_dim=64, hidden=128, layers=2),
    "untied-gqa": dict(tied=False, num_heads=4, num_kv_heads=2, head_dim=128, hidden=96, layers=3),
    "tied-mha-sharded": dict(
        tied=True,
        num_heads=2,
        num_kv_heads=2,
        head_dim=64,
        hidden=128,
        layers=2,
        max_shard_size="100KB",
    ),
}


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


@pytest.fixture(scope="session", params=list(HF_MODEL_SHAPES))
def hf_model(request, tmp_path_factory) -> HFModel:
    """Each shape of HF_MODEL_SHAPES (vocabulary 256), saved by transformers and loaded by jaxllm
    in float32."""
    from support.hf import save_hf_model

    path = tmp_path_factory.mktemp(request.param)
    return save_hf_model(request.param, path, **HF_MODEL_SHAPES[request.param])


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Checkpoint:
    """The engine tests' checkpoint: `random_qwen3()`'s default shape, vocabulary 256."""
    from support.hf import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("qwen3-vocab256"))


@pytest.fixture(scope="session")
def greedy_prompts() -> list[list[int]]:
    from support.engine import PROMPT_LENGTHS
    from support.hf import VOCAB_SIZE

    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB_SIZE, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def greedy_reference(checkpoint, greedy_prompts) -> list[list[int]]:
    from support.engine import NUM_GREEDY_TOKENS

    return [checkpoint.greedy(prompt, NUM_GREEDY_TOKENS) for prompt in greedy_prompts]


@pytest.fixture(scope="session")
def make_llm(checkpoint):
    """make_llm(attention=None, **settings) -> a shared LLM on the vocab-256 checkpoint, built
    once per settings."""
    from support.engine import BASE_SETTINGS, make_llm_with

    engines: dict[tuple, LLM] = {}

    def make(attention: str | None = None, **overrides) -> LLM:
        settings = BASE_SETTINGS | overrides
        key = (attention, *sorted(settings.items()))
        if key not in engines:
            engines[key] = make_llm_with(checkpoint.path, attention, **settings)
        return engines[key]

    return make


@pytest.fixture(scope="session")
def llm(make_llm) -> LLM:
    """The default engine: prefix caching on, budget 256 tokens, block 16, 8 sequences."""
    return make_llm()


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> str:
    """A random qwen3-tiny of hidden size 64 (the real vocabulary, the embedded tokenizer and its
    eos tokens), saved by jaxllm: its LM head reads a quarter of qwen3-tiny's bytes a step."""
    import dataclasses
    import json

    from jaxllm.model.checkpoint import save_params
    from jaxllm.model.config import PRESETS
    from jaxllm.model.qwen3 import init_params
    from jaxllm.tokenizer import qwen3_tokenizer

    config = dataclasses.replace(PRESETS["qwen3-tiny"], hidden_size=64)
    path = tmp_path_factory.mktemp("qwen3-tiny-narrow")
    save_params(path, config, init_params(config))
    tokenizer = qwen3_tokenizer()
    eos = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return str(path)


@pytest.fixture(scope="session")
def text_llm(text_model) -> LLM:
    """A random model of the real vocabulary and tokenizer (`text_model`), for text tests."""
    from jaxllm import LLM

    return LLM(
        text_model,
        max_num_seqs=4,
        max_model_len=256,
        max_num_batched_tokens=64,
        kvcache_block_size=16,
        compile_at_startup=False,
    )
