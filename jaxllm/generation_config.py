"""A model's generation_config.json: its eos tokens and the sampling defaults vLLM takes from
it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from jaxllm.fields import as_int
from jaxllm.model.config import read_json
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def generation_config(model_path: str) -> tuple[Path, dict[str, Any]]:
    """The model's generation_config.json and its fields ({} without one).

    Raises:
        ValueError: not a JSON object, naming the file.
    """
    path = Path(model_path) / "generation_config.json"
    found = read_json(path) if path.is_file() else {}
    if not isinstance(found, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(found).__name__}")
    return path, found


def eos_token_ids(tokenizer, model_path: str) -> tuple[int, ...]:
    """The tokenizer's eos plus those of the model's generation_config.json."""
    own = tokenizer.eos_token_id
    ids = set() if own is None else {int(own)}
    path, found = generation_config(model_path)
    eos = found.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(as_int(token) is not None and 0 <= token < 2**31 for token in eos):
        raise ValueError(f"{path}: eos_token_id must be token ids, got {eos!r}")
    ids.update(eos)
    return tuple(sorted(ids))


# generation_config.json's sampling fields that vLLM takes as a model's defaults -> their
# SamplingParams names.
GENERATION_DEFAULTS = {"max_new_tokens": "max_tokens"} | {
    name: name for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
}


def default_sampling_params(model_path: str) -> SamplingParams:
    """SamplingParams() with the sampling fields of the model's generation_config.json over
    its defaults, as vLLM takes them (`GENERATION_DEFAULTS`).

    Raises:
        ValueError: a value SamplingParams refuses, naming the file.
    """
    path, found = generation_config(model_path)
    given = {name: value for name, value in found.items() if value is not None}
    fields = {ours: given[name] for name, ours in GENERATION_DEFAULTS.items() if name in given}
    if fields:  # NOTE: as vLLM, said once: calls without sampling params sample differently
        logger.info("sampling defaults from %s: %s", path, fields)
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def generation_fields(params: SamplingParams) -> dict[str, Any]:
    """The generation_config.json fields that `default_sampling_params` reads back as
    `params` (those that differ from SamplingParams()'s)."""
    plain = SamplingParams()
    return {
        theirs: getattr(params, ours)
        for theirs, ours in GENERATION_DEFAULTS.items()
        if getattr(params, ours) != getattr(plain, ours)
    }
