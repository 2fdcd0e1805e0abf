"""What the engine needs before it serves: the compilation cache, the model's files and eos ids,
and the timing of start-up's phases."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import jax

from jaxllm.model.checkpoint import RANDOM_PREFIX

logger = logging.getLogger(__name__)


# JAX's persistent compilation cache, a setting of the process: "" leaves it off.
COMPILATION_CACHE_ENV = "JAXLLM_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = "~/.cache/jaxllm/xla"


def configure_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache in `$JAXLLM_COMPILATION_CACHE` (default
    ~/.cache/jaxllm/xla), unless it is "" or the process set a cache already."""
    directory = os.path.expanduser(os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE))
    if not directory or jax.config.jax_compilation_cache_dir:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def resolve_model(model: str) -> str:
    """A local directory or `random:<shape>` for `model`; Hub ids are downloaded if possible."""
    if model.startswith(RANDOM_PREFIX) or Path(model).is_dir():
        return model
    if Path(model).exists():
        raise FileNotFoundError(f"model path {model!r} is not a directory")
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise FileNotFoundError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
        )
    except Exception as error:
        raise FileNotFoundError(
            f"model {model!r} is not a local directory and could not be downloaded from the "
            f"Hugging Face Hub ({type(error).__name__}: {error}); pass a local path or "
            "random:<shape>"
        ) from error


def eos_token_ids(tokenizer, model_path: str) -> tuple[int, ...]:
    """The tokenizer's eos plus those of the model's generation_config.json."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        import json

        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return tuple(sorted(ids))


@contextlib.contextmanager
def timed_phase(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to `seconds[name]` and logs it."""
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    seconds[name] = seconds.get(name, 0.0) + elapsed
    logger.info("%s: %.1f s", name, elapsed)
