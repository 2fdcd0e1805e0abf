"""Shared fixtures of the engine tests: tiny random Qwen3 checkpoints written by transformers,
their greedy references, and a few session-scoped engines (compiled lazily, bucket by bucket).

Engines are built once per settings (`make_llm`) and shared: on a 2-core CPU each bucket takes
about half a second to compile, so tests reuse a few small ladders.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import transformers
from hf_reference import random_qwen3

from jaxllm import LLM, SamplingParams
from jaxllm.platform import ATTENTION_ENV

VOCAB_SIZE = 256
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
# Prompt lengths of the greedy batch: 1 to 300 tokens, around block boundaries (16).
PROMPT_LENGTHS = (1, 2, 15, 16, 17, 33, 64, 100, 200, 300)
NUM_GREEDY_TOKENS = 24

# The settings most engines share (a small ladder, lazy compilation).
BASE_SETTINGS = dict(
    max_num_seqs=8,
    max_model_len=MAX_MODEL_LEN,
    max_num_batched_tokens=256,
    kvcache_block_size=BLOCK_SIZE,
    dtype="float32",
    compile_at_startup=False,
)


def make_hf_model(vocab_size: int = VOCAB_SIZE, hidden: int = 64, layers: int = 2, seed: int = 0):
    """A float32 transformers Qwen3 with every weight random (norm scales around 1)."""
    return random_qwen3(
        vocab_size=vocab_size,
        hidden=hidden,
        layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        tied=False,
        max_position_embeddings=MAX_MODEL_LEN,
        seed=seed,
    )


@dataclass
class Checkpoint:
    """A saved transformers checkpoint and its torch model."""

    path: Path
    torch_model: transformers.Qwen3ForCausalLM

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """transformers' greedy continuation of exactly `num_tokens` tokens."""
        with torch.no_grad():
            out = self.torch_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    def last_logits(self, prompt: list[int]) -> np.ndarray:
        """[V] float64 logits of transformers at the prompt's last position."""
        with torch.no_grad():
            logits = self.torch_model(torch.tensor([prompt])).logits[0, -1]
        return logits.double().numpy()

    def with_generation_config(self, directory: Path, **fields) -> Path:
        """A copy of the checkpoint in `directory` with these generation_config.json fields."""
        shutil.copytree(self.path, directory)
        (directory / "generation_config.json").write_text(json.dumps(fields))
        return directory


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Checkpoint:
    model = make_hf_model()
    path = tmp_path_factory.mktemp("qwen3-vocab256")
    model.save_pretrained(path)
    return Checkpoint(path, model)


@pytest.fixture(scope="session")
def greedy_prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB_SIZE, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def greedy_reference(checkpoint, greedy_prompts) -> list[list[int]]:
    return [checkpoint.greedy(prompt, NUM_GREEDY_TOKENS) for prompt in greedy_prompts]


def greedy_params(num_tokens: int = NUM_GREEDY_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, **fields)


def make_llm_with(model, attention: str | None = None, **settings) -> LLM:
    """An LLM whose platform runs the `attention` backend (`JAXLLM_ATTENTION_BACKEND`)."""
    environment = {ATTENTION_ENV: attention} if attention else {}
    with mock.patch.dict(os.environ, environment):
        return LLM(str(model), **settings)


@pytest.fixture(scope="session")
def make_llm(checkpoint):
    """make_llm(attention=None, **settings) -> a shared LLM on the vocab-256 checkpoint, built
    once per settings."""
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
def text_llm() -> LLM:
    """The embedded random qwen3-tiny (the real vocabulary and tokenizer), for text tests."""
    return LLM(
        "random:qwen3-tiny",
        max_num_seqs=4,
        max_model_len=256,
        max_num_batched_tokens=64,
        kvcache_block_size=16,
        compile_at_startup=False,
    )


def assert_idle(llm: LLM) -> None:
    """Nothing queued or running, every block free, the scheduler's invariants hold."""
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished()
    scheduler.check_integrity()
    assert scheduler.block_pool.num_free_blocks == scheduler.config.num_blocks
