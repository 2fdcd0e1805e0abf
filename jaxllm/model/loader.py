"""Loads a Hugging Face Qwen3 checkpoint (config.json + safetensors shards) into the param tree.

One table, `HF_WEIGHTS`, maps every Hugging Face tensor name to a param path and a layout. All
names and shapes are checked against it before any data is read, and one `CheckpointError`
names every missing, unmapped, duplicated or mis-shaped tensor.

Sharded reading: each param is built device by device. For one device, the block of the param
it holds (all of it without tensor parallelism) is read from every layer's tensor through
`safe_open(...).get_slice` (memory-mapped: only the rows or columns of that block are read),
converted into one host buffer, and sent to that device before the next device's block is
read. Host memory so holds one device's block of one stacked param at a time, never the model;
with several processes (`jax.distributed`) each reads only the blocks of its own devices.

Legend: L layers, D model dim, N query heads, K kv heads, H head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxllm.model.config import Qwen3Config
from jaxllm.model.qwen3 import Params, abstract_params, param_shardings
from jaxllm.model.sharding import check_tensor_parallel, make_mesh, tensor_parallel_size

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: every offending tensor is named."""


@dataclass(frozen=True)
class Layout:
    """How a Hugging Face tensor becomes a param (one layer's slice for stacked params).

    `linear_in_axes == 0` copies the tensor. Otherwise the tensor is a torch Linear weight
    [out, in]: it is transposed and reshaped so that the param's first `linear_in_axes` axes
    are the input features (e.g. q_proj [N*H, D] -> [D, N, H], o_proj [D, N*H] -> [N, H, D]).
    A block of the param that splits only the leading axis of its input or its output axes
    (every sharding of `sharding.py`) is a contiguous range of the tensor's columns or rows.
    """

    linear_in_axes: int = 0

    def hf_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.linear_in_axes:
            return tuple(param_shape)
        split = self.linear_in_axes
        return (math.prod(param_shape[split:]), math.prod(param_shape[:split]))

    def convert(self, tensor: np.ndarray, param_shape: tuple[int, ...]) -> np.ndarray:
        if not self.linear_in_axes:
            return tensor
        return tensor.T.reshape(param_shape)

    def hf_index(self, param_shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The slices of the Hugging Face tensor that hold the block `index` of the param."""
        if not self.linear_in_axes:
            return index
        split = self.linear_in_axes
        rows = _flat_slice(param_shape[split:], index[split:])
        columns = _flat_slice(param_shape[:split], index[:split])
        return rows, columns


def _flat_slice(shape: tuple[int, ...], index: tuple[slice, ...]) -> slice:
    """The range of the flattened `shape` that is the block `index`, in which only the leading
    axis may be partial (a NotImplementedError otherwise)."""
    start, stop, _ = index[0].indices(shape[0])
    for size, part in zip(shape[1:], index[1:], strict=True):
        if part.indices(size) != (0, size, 1):
            raise NotImplementedError(f"a block {index} of shape {shape} is not contiguous")
    inner = math.prod(shape[1:])
    return slice(start * inner, stop * inner)


COPY = Layout()
LINEAR = Layout(linear_in_axes=1)
LINEAR_FROM_HEADS = Layout(linear_in_axes=2)

# Hugging Face name -> (param path, layout). `{i}` is the layer; those params are stacked [L, ...].
HF_WEIGHTS: dict[str, tuple[tuple[str, ...], Layout]] = {
    "model.embed_tokens.weight": (("embed",), COPY),
    "model.layers.{i}.input_layernorm.weight": (("layers", "attn_norm", "scale"), COPY),
    "model.layers.{i}.self_attn.q_proj.weight": (("layers", "attn", "q_proj"), LINEAR),
    "model.layers.{i}.self_attn.k_proj.weight": (("layers", "attn", "k_proj"), LINEAR),
    "model.layers.{i}.self_attn.v_proj.weight": (("layers", "attn", "v_proj"), LINEAR),
    "model.layers.{i}.self_attn.o_proj.weight": (("layers", "attn", "o_proj"), LINEAR_FROM_HEADS),
    "model.layers.{i}.self_attn.q_norm.weight": (("layers", "attn", "q_norm", "scale"), COPY),
    "model.layers.{i}.self_attn.k_norm.weight": (("layers", "attn", "k_norm", "scale"), COPY),
    "model.layers.{i}.post_attention_layernorm.weight": (("layers", "mlp_norm", "scale"), COPY),
    "model.layers.{i}.mlp.gate_proj.weight": (("layers", "mlp", "gate_proj"), LINEAR),
    "model.layers.{i}.mlp.up_proj.weight": (("layers", "mlp", "up_proj"), LINEAR),
    "model.layers.{i}.mlp.down_proj.weight": (("layers", "mlp", "down_proj"), LINEAR),
    "model.norm.weight": (("final_norm", "scale"), COPY),
    "lm_head.weight": (("lm_head",), LINEAR),
}
# Present in some tied checkpoints; equal to the embedding, so not read.
TIED_EXTRA = "lm_head.weight"


def default_dtype(config: Qwen3Config) -> str:
    """bfloat16 when the default jax backend is a GPU, else the checkpoint's own dtype."""
    return "bfloat16" if jax.default_backend() == "gpu" else config.dtype


def safetensors_files(path: Path) -> list[Path]:
    """The shard files of a checkpoint directory (from the index when there is one)."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def _get(tree: dict[str, Any], param_path: tuple[str, ...]) -> Any:
    for key in param_path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], param_path: tuple[str, ...], value: Any) -> None:
    for key in param_path[:-1]:
        tree = tree.setdefault(key, {})
    tree[param_path[-1]] = value


def _expected_tensors(
    config: Qwen3Config, shapes: Params
) -> dict[str, tuple[tuple[str, ...], int | None, Layout, tuple[int, ...]]]:
    """HF name -> (param path, layer or None, layout, expected HF shape) for this config."""
    expected = {}
    for pattern, (param_path, layout) in HF_WEIGHTS.items():
        if param_path == ("lm_head",) and config.tie_word_embeddings:
            continue
        param_shape = _get(shapes, param_path).shape
        if "{i}" in pattern:
            hf_shape = layout.hf_shape(param_shape[1:])
            for layer in range(config.num_layers):
                expected[pattern.format(i=layer)] = (param_path, layer, layout, hf_shape)
        else:
            expected[pattern] = (param_path, None, layout, layout.hf_shape(param_shape))
    return expected


def load_hf_checkpoint(
    path: str | Path, dtype: str | None = None, progress: bool = True, mesh: Mesh | None = None
) -> tuple[Qwen3Config, Params]:
    """Reads a Hugging Face Qwen3 directory into device params, sharded over `mesh`.

    Args:
        path: directory with config.json and one or many *.safetensors (sharded ones with
            model.safetensors.index.json).
        dtype: param dtype name; default `default_dtype(config)`.
        progress: show a tqdm bar over the tensors.
        mesh: the "tp" mesh the params are sharded over (`sharding.py`); default the first
            device alone.

    Returns:
        The config (its dtype the params') and the param tree.

    Raises:
        CheckpointError: naming every missing, unmapped, duplicated or mis-shaped tensor.
        ValueError: the config.json describes an unsupported model, or one whose heads do not
            split over the mesh.
    """
    path = Path(path)
    config = Qwen3Config.from_hf(path)
    config = config.replace(dtype=dtype or default_dtype(config))
    mesh = mesh or make_mesh(1)
    check_tensor_parallel(config, tensor_parallel_size(mesh))
    shapes = abstract_params(config)
    shardings = param_shardings(config, mesh)
    expected = _expected_tensors(config, shapes)
    target_dtype = np.dtype(config.jnp_dtype)

    with contextlib.ExitStack() as stack:
        handles = {}
        problems = []
        for file in safetensors_files(path):
            handle = stack.enter_context(safe_open(file, framework="numpy"))
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in handles:
                    problems.append(f"duplicated tensor {name} (in {file.name} and another file)")
                handles[name] = handle
        for name in sorted(expected.keys() - handles.keys()):
            problems.append(f"missing tensor {name}")
        for name in sorted(handles.keys() - expected.keys()):
            if not (name == TIED_EXTRA and config.tie_word_embeddings):
                problems.append(f"unmapped tensor {name}")
        for name, (_, _, _, hf_shape) in expected.items():
            if name in handles:
                shape = tuple(handles[name].get_slice(name).get_shape())
                if shape != hf_shape:
                    problems.append(f"tensor {name} has shape {shape}, expected {hf_shape}")
        if problems:
            raise CheckpointError(
                f"checkpoint {path} does not fit {config}:\n  " + "\n  ".join(problems)
            )

        by_param: dict[tuple[str, ...], list[str]] = {}
        for name, (param_path, *_) in expected.items():
            by_param.setdefault(param_path, []).append(name)
        params: Params = {}
        with tqdm(total=len(expected), desc="loading weights", disable=not progress) as bar:
            for param_path, names in by_param.items():
                shape = _get(shapes, param_path).shape
                sharding = _get(shardings, param_path)
                blocks = []
                for device, index in sharding.addressable_devices_indices_map(shape).items():
                    host = _read_block(handles, expected, names, shape, index, target_dtype)
                    # NOTE: waiting bounds host memory to one block even if transfers lag reads.
                    blocks.append(jax.device_put(host, device).block_until_ready())
                    del host
                array = jax.make_array_from_single_device_arrays(shape, sharding, blocks)
                _set(params, param_path, array)
                bar.update(len(names))
    return config, params


def _read_block(
    handles: dict[str, Any],
    expected: dict[str, tuple[tuple[str, ...], int | None, Layout, tuple[int, ...]]],
    names: list[str],
    shape: tuple[int, ...],
    index: tuple[slice, ...],
    dtype: np.dtype,
) -> np.ndarray:
    """The block `index` of the param of global `shape` made of the tensors `names` (one per
    layer for stacked params), read from the checkpoint's slices only."""
    parts = zip(index, shape, strict=True)
    block_shape = tuple(len(range(*part.indices(size))) for part, size in parts)
    host = np.empty(block_shape, dtype)
    for name in names:
        _, layer, layout, _ = expected[name]
        if layer is None:
            param_shape, param_index, target = shape, index, host
        else:
            # NOTE: layers are never sharded (`sharding.py`): the block holds every layer.
            param_shape, param_index, target = shape[1:], index[1:], host[layer]
        tensor = handles[name].get_slice(name)[layout.hf_index(param_shape, param_index)]
        target[...] = layout.convert(tensor, target.shape)
        del tensor
    return host
