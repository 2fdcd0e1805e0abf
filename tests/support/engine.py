"""The settings the engine tests share, and helpers to build an engine and check it is idle.

Engines are built once per settings (the `make_llm` fixture) and shared: on a 2-core CPU each
bucket takes about half a second to compile, so tests reuse a few small ladders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from unittest import mock

from jaxllm import LLM, SamplingParams
from jaxllm.platform import ATTENTION_ENV, Platform

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


def greedy_params(num_tokens: int = NUM_GREEDY_TOKENS, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, **fields)


@contextlib.contextmanager
def gpu_kernel_settings(**changes):
    """Engines built inside run this platform's kernels with `changes` (`Kernels` fields an
    NVIDIA GPU sets, e.g. `fixed_inputs=True`), so their host paths run on a CPU too."""
    kernels = Platform.kernels
    changed = lambda self, *args: dataclasses.replace(kernels(self, *args), **changes)
    with mock.patch.object(Platform, "kernels", changed):
        yield


def make_llm_with(model, attention: str | None = None, **settings) -> LLM:
    """An LLM whose platform runs the `attention` backend (`JAXLLM_ATTENTION_BACKEND`)."""
    environment = {ATTENTION_ENV: attention} if attention else {}
    with mock.patch.dict(os.environ, environment):
        return LLM(str(model), **settings)


def assert_idle(llm: LLM) -> None:
    """Nothing queued or running, every block free, the scheduler's invariants hold."""
    scheduler = llm.engine.scheduler
    assert not scheduler.has_unfinished()
    scheduler.check_integrity()
    assert scheduler.block_pool.num_free_blocks == scheduler.config.num_blocks
