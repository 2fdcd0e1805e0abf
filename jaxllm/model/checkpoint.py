"""Orbax checkpoints of the param tree, and `load_params`, the one entry point for weights.

A checkpoint is written atomically (`atomic_directory`), with a manifest of every param's shape,
dtype and checksum that loading verifies. Every loader puts on each device of the "tp" mesh
(default: the first device alone) only its blocks, once `check_params_fit` has found room.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash
from flax.traverse_util import flatten_dict
from jax.sharding import Mesh

from jaxllm.model.config import PRESETS, Qwen3Config, param_bytes, read_json
from jaxllm.model.loader import CheckpointError, check_hf_checkpoint, load_hf_checkpoint
from jaxllm.model.qwen3 import Params, abstract_params, init_params, sharded_param_shapes
from jaxllm.model.sharding import check_tensor_parallel, make_mesh, tensor_parallel_size

CONFIG_FILE = "jaxllm_config.json"
MANIFEST_FILE = "jaxllm_manifest.json"
PARAMS_DIR = "params"
RANDOM_PREFIX = "random:"
MEMINFO = Path("/proc/meminfo")


@contextlib.contextmanager
def atomic_directory(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields a fresh temporary directory beside `path` to write into; on success its entries
    become `path`'s, and on any exception (KeyboardInterrupt too) it is removed, `path` untouched.

    A missing or empty `path` is replaced by the temporary directory in one rename. With
    `overwrite`, a non-empty `path` keeps every entry but those of the same names as the written
    ones, which are replaced.

    Raises:
        ValueError: at once, before anything is written: `path` is not a directory, or is a
            non-empty one and `overwrite` is false.
    """
    path = Path(path).expanduser().resolve()
    _check_writable(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: a sibling, so that renaming it is atomic; made by mkdir, so it has the umask's mode.
    staging = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        yield staging
        _check_writable(path, overwrite)  # again: something may have been written meanwhile
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        if not path.exists():
            staging.rename(path)
        else:
            _move_entries(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_writable(path: Path, overwrite: bool) -> None:
    existing = next(entry for entry in (path, *path.parents) if entry.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot save to {path}: {existing} exists and is not a directory")
    if path.is_dir() and not overwrite and any(path.iterdir()):
        raise ValueError(
            f"cannot save to {path}: the directory is not empty (pass overwrite=True to replace "
            "the entries of the same names and keep the others)"
        )


def _move_entries(source: Path, target: Path) -> None:
    """Moves each entry of `source` into `target`, replacing one of the same name; on any
    exception puts back what it moved, so that `target` is as it was."""
    replaced = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    replaced.mkdir()
    names = sorted(entry.name for entry in source.iterdir())
    try:
        for name in names:
            if os.path.lexists(target / name):
                (target / name).rename(replaced / name)
            (source / name).rename(target / name)
    except BaseException:
        for name in names:
            if not os.path.lexists(source / name):
                (target / name).rename(source / name)
        for old in replaced.iterdir():
            old.rename(target / old.name)
        replaced.rmdir()  # NOTE: not removed if anything is left in it: the user's entries
        raise
    shutil.rmtree(replaced)


def save_model(
    path: str | Path,
    config: Qwen3Config,
    params: Params,
    tokenizer: Any,
    generation_config: dict[str, Any],
    overwrite: bool = False,
) -> None:
    """A directory that loads back as the model (`LLM.save`), `generation_config` its
    generation_config.json: written beside `path`, moved in at the end (`atomic_directory`)."""
    with atomic_directory(path, overwrite=overwrite) as staging:
        save_params(staging, config, params)
        tokenizer.save_pretrained(staging)
        (staging / "generation_config.json").write_text(
            json.dumps(generation_config, indent=2) + "\n"
        )


def save_params(path: str | Path, config: Qwen3Config, params: Params) -> None:
    """Writes `params` as an orbax checkpoint under `path/params`, the config beside it and a
    manifest of every leaf's shape, dtype and checksum (xxh3_64 of its bytes).

    NOTE: a leaf spread over several processes gets no checksum (its bytes are not all here).
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    (path / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
    flat = flatten_dict(params, sep="/")
    leaves = {name: _describe(leaf, checksum=True) for name, leaf in flat.items()}
    manifest = {"checksum": "xxh3_64", "leaves": leaves}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


def _describe(leaf: Any, checksum: bool) -> dict[str, Any]:
    """A leaf's manifest record: shape, dtype and, if asked and its bytes are here, checksum."""
    record = {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
    if checksum:
        local = getattr(leaf, "is_fully_addressable", True)
        record["xxh3_64"] = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(leaf)) if local else None
    return record


def _verify(path: Path, manifest: dict[str, Any], tree: Params, checksum: bool) -> None:
    """Raises a CheckpointError naming every leaf of `tree` whose shape, dtype or (if asked)
    checksum differs from the manifest's, and every leaf that only one of them has."""
    saved = manifest.get("leaves") if isinstance(manifest, dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path / MANIFEST_FILE} holds no leaves (name -> shape, dtype)")
    found = {name: _describe(leaf, checksum) for name, leaf in flatten_dict(tree, sep="/").items()}
    problems = [f"{name}: in the manifest, not in the model" for name in saved.keys() - found]
    problems += [f"{name}: in the model, not in the manifest" for name in found.keys() - saved]
    for name in sorted(found.keys() & saved.keys()):
        for field, value in found[name].items():
            expected = saved[name].get(field)
            if value is not None and expected is not None and value != expected:
                problems.append(f"{name}: {field} {value}, saved as {expected}")
    if problems:
        raise CheckpointError(
            f"orbax checkpoint {path} does not match its manifest ({MANIFEST_FILE}):\n  "
            + "\n  ".join(sorted(problems))
        )


def _saved_config(path: Path) -> Qwen3Config:
    fields = read_json(path / CONFIG_FILE)
    try:
        return Qwen3Config(**fields)
    except TypeError as error:  # not a dict, or other keys than Qwen3Config's
        raise CheckpointError(f"{path / CONFIG_FILE} is not a Qwen3Config: {error}") from None


def load_orbax_checkpoint(
    path: str | Path, dtype: str | None = None, mesh: Mesh | None = None
) -> tuple[Qwen3Config, Params]:
    """Reads a directory written by `save_params` (with any mesh) onto the devices of `mesh`,
    the params cast to `dtype` (a dtype name; default: the saved config's).

    The params are checked against the manifest: shapes and dtypes before they are read,
    checksums after (each leaf copied to the host in turn). A checkpoint without a manifest
    (saved by an older jaxllm) loads unverified.

    Raises:
        CheckpointError: naming every leaf whose shape, dtype or checksum is not the manifest's,
            or the first error reading the array files (one missing or cut short).
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    saved = _saved_config(path)
    manifest = read_json(path / MANIFEST_FILE) if (path / MANIFEST_FILE).exists() else None
    target = sharded_param_shapes(saved, mesh or make_mesh(1))
    if manifest is not None:
        _verify(path, manifest, target, checksum=False)
    # NOTE: read in the saved dtype, so that the checksums are of the saved bytes.
    try:
        params = ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)
    except Exception as error:  # NOTE: tensorstore raises bare Exceptions, the reason inside
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        reason = str(cause).splitlines()[0][:500]
        raise CheckpointError(f"cannot read the orbax checkpoint {path}: {reason}") from error
    if manifest is not None:
        _verify(path, manifest, params, checksum=True)
    config = saved.replace(dtype=dtype or saved.dtype)
    if config.dtype != saved.dtype:
        leaves, treedef = jax.tree.flatten(params)
        del params
        for i, leaf in enumerate(leaves):  # NOTE: one leaf at a time beside the saved params
            leaves[i] = leaf.astype(config.jnp_dtype)
            leaf.delete()
        params = jax.tree.unflatten(treedef, leaves)
    return config, params


def available_memory_bytes(device: jax.Device | None = None) -> int:
    """Bytes free for new arrays on `device` (default: the first): its `memory_stats()` limit
    less what is in use, or for a device without them (a CPU) the host's available memory."""
    return _memory_bytes(device, whole=False)


def memory_bytes(device: jax.Device | None = None) -> int:
    """Bytes `device` (default: the first) holds in all: its `memory_stats()` limit, or for a
    device without them (a CPU) the host's memory."""
    return _memory_bytes(device, whole=True)


def _memory_bytes(device: jax.Device | None, whole: bool) -> int:
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - (0 if whole else stats.get("bytes_in_use", 0))
    field, pages = ("MemTotal:", "SC_PHYS_PAGES") if whole else ("MemAvailable:", "SC_AVPHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        for line in MEMINFO.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024  # "MemAvailable:  123456 kB"
    return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def check_fits(what: str, bytes_per_device: int, mesh: Mesh, whole: bool = False) -> None:
    """Raises a ValueError naming `what` if `bytes_per_device` on each device of `mesh` in this
    process is more than is available there (devices without memory stats, CPUs, share the
    host's memory); for before allocating. `whole`: more than the devices hold in all, whatever
    uses them now."""
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    memory, state = (memory_bytes, "in all") if whole else (available_memory_bytes, "available")
    if "bytes_limit" in (devices[0].memory_stats() or {}):
        needed, available = bytes_per_device, min(memory(d) for d in devices)
        where = f"per device ({devices[0].device_kind})"
    else:
        needed, available = bytes_per_device * len(devices), memory(devices[0])
        where = "in host memory"
    if needed > available:
        raise ValueError(
            f"{what} take {needed / 1e9:.2f} GB {where}, more than the "
            f"{available / 1e9:.2f} GB {state}"
        )


def check_params_fit(config: Qwen3Config, mesh: Mesh, whole: bool = False) -> None:
    """`check_fits` for the params of `config` sharded over `mesh`; a ValueError too if the
    mesh does not divide the model."""
    tp = tensor_parallel_size(mesh)
    check_tensor_parallel(config, tp)
    layers = f"{config.num_layers} layers of hidden size {config.hidden_size}"
    check_fits(f"the params ({layers}, {config.dtype})", param_bytes(config, tp), mesh, whole)


def _saved(path_or_preset: str | Path, dtype: str | None = None) -> tuple[str, Qwen3Config]:
    """The kind of `path_or_preset` ("random", "orbax" or "hf") and its config as saved; a
    Hugging Face one's of dtype `dtype` if given (its dtype may be one jaxllm does not run).

    Raises:
        ValueError: an unknown preset or unsupported model.
        CheckpointError: a directory that is not a checkpoint.
    """
    if isinstance(path_or_preset, str) and path_or_preset.startswith(RANDOM_PREFIX):
        name = path_or_preset.removeprefix(RANDOM_PREFIX)
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return "random", PRESETS[name]
    path = Path(path_or_preset)
    if (path / CONFIG_FILE).exists():
        return "orbax", _saved_config(path)
    if (path / "config.json").exists():
        return "hf", Qwen3Config.from_hf(path, dtype)
    raise CheckpointError(
        f"{path_or_preset} is neither a Hugging Face checkpoint (config.json), an orbax "
        f"checkpoint ({CONFIG_FILE}) nor a `{RANDOM_PREFIX}<preset>` name (presets: "
        f"{', '.join(PRESETS)})"
    )


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
        ValueError: an unknown preset or unsupported model, a mesh that does not divide the
            model, or params that do not fit in the memory available (checked before any weight
            is read or made).
        CheckpointError: a directory that is not a checkpoint or does not match its config.
    """
    mesh = mesh or make_mesh(1)
    kind, saved = _saved(path_or_preset, dtype)
    config = saved.replace(dtype=dtype or saved.dtype)
    if kind == "orbax":
        # NOTE: read in the saved dtype, then cast: the wider of the two bounds the memory.
        check_params_fit(max(saved, config, key=lambda c: c.jnp_dtype.itemsize), mesh)
        return load_orbax_checkpoint(path_or_preset, dtype, mesh)
    check_params_fit(config, mesh)
    if kind == "random":
        return config, init_params(config, seed, mesh)
    return load_hf_checkpoint(path_or_preset, dtype, mesh=mesh)


def check_checkpoint(path_or_preset: str | Path, dtype: str | None = None) -> Qwen3Config:
    """The config `load_params` returns, once what it checks before it reads any weight holds
    (an orbax checkpoint's params directory and manifest; a Hugging Face one's index and
    tensor headers), without reading one: for a start-up to refuse a broken checkpoint before
    it compiles anything.

    Raises:
        ValueError, CheckpointError: as `load_params`.
    """
    kind, saved = _saved(path_or_preset, dtype)
    config, path = saved.replace(dtype=dtype or saved.dtype), Path(path_or_preset).absolute()
    if kind == "hf":
        check_hf_checkpoint(path, config)
    elif kind == "orbax":
        if not (path / PARAMS_DIR).is_dir():
            raise CheckpointError(f"orbax checkpoint {path} has no {PARAMS_DIR} directory")
        if (path / MANIFEST_FILE).exists():
            _verify(path, read_json(path / MANIFEST_FILE), abstract_params(saved), checksum=False)
    return config


def load_config(path_or_preset: str | Path, dtype: str | None = None) -> Qwen3Config:
    """The config `load_params` returns (its dtype `dtype`, default the checkpoint's), read
    without any weight.

    Raises:
        ValueError, CheckpointError: as `_saved`.
    """
    saved = _saved(path_or_preset, dtype)[1]
    return saved.replace(dtype=dtype or saved.dtype)
