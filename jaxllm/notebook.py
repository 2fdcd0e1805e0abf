"""One call from a notebook: `jaxllm.generate`, with the one engine it keeps between calls."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxllm.config import EngineConfig
from jaxllm.llm import LLM
from jaxllm.outputs import RequestOutput
from jaxllm.platform import Platform
from jaxllm.prompts import Prompt
from jaxllm.sampling_params import SamplingParams
from jaxllm.startup import check_model, check_settings, engine_settings, resolve_model

# NOTE: one engine at a time: a GPU engine fills most of the device's memory with its KV cache.
# Threads that ask for one wait for one another (`_shared_lock`): it is built once, and alone.
_shared: list[tuple[tuple, LLM]] = []
_shared_lock = threading.Lock()


def generate(
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    model: LLM | str | os.PathLike | None = None,
    use_tqdm: bool = True,
    **engine_kwargs: Any,
) -> list[RequestOutput]:
    """One call from a notebook: `LLM.generate` with `model` (an LLM, a model string, or None
    for the embedded default). The engine is built once per (model, engine_kwargs), reused until
    a call asks for another, and dropped before another is built; arguments refused by their
    checks (names, types, ranges, a model that does not exist or whose checkpoint is broken)
    keep it. A local directory is the same model under any path to it.

    Raises:
        TypeError, ValueError: as `LLM` and `LLM.generate` do; engine_kwargs with an LLM.
        CheckpointError: a checkpoint whose tensors do not fit its config (a ValueError).
        FileNotFoundError: a model that is neither a local directory nor on the Hub.
    """
    if isinstance(model, LLM):
        if engine_kwargs:
            raise TypeError(
                f"engine arguments ({', '.join(sorted(engine_kwargs))}) with an LLM as the "
                "model: it is already built"
            )
        return model.generate(prompts, sampling_params, use_tqdm=use_tqdm)
    check_model(model)
    key = (_model_key(model), tuple(sorted(engine_kwargs.items())))
    with _shared_lock:  # NOTE: through the call: no other engine is built while this one runs
        if not _shared or _shared[0][0] != key:
            engine_kwargs = EngineConfig.check_kwargs(engine_kwargs)
            path = None if model is None else resolve_model(os.fspath(model))  # it exists
            platform = Platform.detect()  # NOTE: LLM's settings, checked as LLM checks them
            check_settings(*engine_settings(path, engine_kwargs, platform), platform)
            _shared.clear()
            _shared.append((key, LLM(path, **engine_kwargs)))
        return _shared[0][1].generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _model_key(model: str | os.PathLike | None) -> str | None:
    """The model as the shared engine is keyed: a local directory by its resolved path."""
    if model is None:
        return None
    local = Path(os.fspath(model)).expanduser()
    return str(local.resolve()) if local.is_dir() else os.fspath(model)
