"""Orbax checkpoints of the param tree, and `load_params`, the one entry point for weights.

Every loader takes the "tp" mesh (`sharding.make_mesh`; default: the first device alone) and puts
on each device only its blocks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxllm.model.config import PRESETS, Qwen3Config
from jaxllm.model.loader import CheckpointError, load_hf_checkpoint
from jaxllm.model.qwen3 import Params, abstract_params, init_params, param_shardings
from jaxllm.model.sharding import make_mesh

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
    (path / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")


def load_orbax_checkpoint(
    path: str | Path, dtype: str | None = None, mesh: Mesh | None = None
) -> tuple[Qwen3Config, Params]:
    """Reads a directory written by `save_params` (with any mesh) onto the devices of `mesh`,
    the params cast to `dtype` (a dtype name; default: the saved config's)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    config = Qwen3Config(**json.loads((path / CONFIG_FILE).read_text()))
    config = config.replace(dtype=dtype or config.dtype)
    target = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_params(config),
        param_shardings(config, mesh or make_mesh(1)),
    )
    return config, ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)


def load_params(
    path_or_preset: str | Path, dtype: str | None = None, seed: int = 0, mesh: Mesh | None = None
) -> tuple[Qwen3Config, Params]:
    """Loads model params from a Hugging Face directory, an orbax directory or a random preset:
    the config (its dtype the params') and the param tree on the mesh's devices.

    Args:
        path_or_preset: a Hugging Face Qwen3 directory (config.json + *.safetensors), a
            directory written by `save_params`, or `random:<name>` with a name in `PRESETS`.
        dtype: param dtype name; default the checkpoint's or preset's.
        seed: the random preset's seed.

    Raises:
        ValueError: an unknown preset or unsupported model, or a mesh that does not divide the
            model (checked before any weight is read).
        CheckpointError: a directory that is not a checkpoint or does not match its config.
    """
    if isinstance(path_or_preset, str) and path_or_preset.startswith(RANDOM_PREFIX):
        name = path_or_preset.removeprefix(RANDOM_PREFIX)
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        config = PRESETS[name].replace(dtype=dtype or PRESETS[name].dtype)
        return config, init_params(config, seed, mesh or make_mesh(1))
    path = Path(path_or_preset)
    if (path / CONFIG_FILE).exists():
        return load_orbax_checkpoint(path, dtype, mesh)
    if (path / "config.json").exists():
        return load_hf_checkpoint(path, dtype, mesh=mesh)
    raise CheckpointError(
        f"{path} is neither a Hugging Face checkpoint (config.json), an orbax checkpoint "
        f"({CONFIG_FILE}) nor a `{RANDOM_PREFIX}<preset>` name (presets: {', '.join(PRESETS)})"
    )
