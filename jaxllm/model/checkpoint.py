"""Orbax checkpoints of the param tree, and `load_params`, the one entry point for weights.

An orbax checkpoint directory holds `params/` (orbax) and `jaxllm_config.json` (the config).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from jaxllm.model.config import PRESETS, Qwen3Config
from jaxllm.model.loader import CheckpointError, default_dtype, load_hf_checkpoint
from jaxllm.model.qwen3 import Params, abstract_params, init_params

CONFIG_FILE = "jaxllm_config.json"
PARAMS_DIR = "params"
RANDOM_PREFIX = "random:"


def save_params(path: str | Path, config: Qwen3Config, params: Params) -> None:
    """Writes `params` as an orbax checkpoint under `path/params` and the config beside it."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    (path / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def load_orbax_checkpoint(path: str | Path, dtype: str | None = None) -> tuple[Qwen3Config, Params]:
    """Reads a directory written by `save_params` onto the default device.

    Args:
        path: the checkpoint directory.
        dtype: param dtype name (the saved params are cast); default: the saved config's.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    config = Qwen3Config.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    if dtype:
        config = config.replace(dtype=dtype)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_params(config),
    )
    params = ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)
    return config, params


def load_params(
    path_or_preset: str | Path, dtype: str | None = None, seed: int = 0
) -> tuple[Qwen3Config, Params]:
    """Loads model params from a Hugging Face directory, an orbax directory or a random preset.

    Args:
        path_or_preset: a Hugging Face Qwen3 directory (config.json + *.safetensors), a
            directory written by `save_params`, or `random:<preset>` with a name in `PRESETS`
            (random weights made on the device).
        dtype: param dtype name; default bfloat16 on a GPU, else the checkpoint's or preset's.
        seed: the random preset's seed.

    Returns:
        The config (its dtype the params') and the param tree on the default device.

    Raises:
        ValueError: an unknown preset or unsupported model; `CheckpointError` for a directory
            that is not a checkpoint or does not match its config.
    """
    if isinstance(path_or_preset, str) and path_or_preset.startswith(RANDOM_PREFIX):
        name = path_or_preset.removeprefix(RANDOM_PREFIX)
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        config = PRESETS[name]
        config = config.replace(dtype=dtype or default_dtype(config))
        return config, init_params(config, seed)
    path = Path(path_or_preset)
    if (path / CONFIG_FILE).exists():
        saved = Qwen3Config.from_dict(json.loads((path / CONFIG_FILE).read_text()))
        return load_orbax_checkpoint(path, dtype or default_dtype(saved))
    if (path / "config.json").exists():
        return load_hf_checkpoint(path, dtype)
    raise CheckpointError(
        f"{path} is neither a Hugging Face checkpoint (config.json), an orbax checkpoint "
        f"({CONFIG_FILE}) nor a `{RANDOM_PREFIX}<preset>` name (presets: {', '.join(PRESETS)})"
    )
