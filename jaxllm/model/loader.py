"""Loads a Hugging Face Qwen3 checkpoint (config.json + safetensors shards) into the param tree.

One table, `hf_weights`, maps every Hugging Face tensor name to a param path, a layout and, for
fused weights, the part of the param it fills; names, shapes and dtypes are checked against it,
and the index's file names against the directory, before any data is read.

Each param is built device by device: that device's block is read (`safe_open(...).get_slice`,
memory-mapped: only its rows or columns) into a host buffer and sent to the device before the
next block is read, so host memory holds one block at a time. With several processes
(`jax.distributed`) each reads only its own devices' blocks.

Legend: D model dim, N query heads, K kv heads, G = N / K, H head dim, F ffn dim, V vocab.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from jaxllm.model.config import Qwen3Config, read_json
from jaxllm.model.qwen3 import Params, abstract_params, sharded_param_shapes
from jaxllm.model.sharding import make_mesh

INDEX_FILE = "model.safetensors.index.json"
# A CheckpointError lists this many problems at most (a config of 10^5 layers has millions).
MAX_PROBLEMS_SHOWN = 50
# The safetensors dtypes a weight may have (read into the model's dtype).
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
# Present in some tied checkpoints; equal to the embedding, so not read (as in vLLM), or read
# as the embedding where it is the one stored (`safetensors.torch.save_model` keeps it).
TIED_EXTRA = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: every offending tensor is named."""


@dataclass(frozen=True)
class Layout:
    """How a Hugging Face tensor becomes a param.

    `linear_in_axes == 0` copies the tensor. Otherwise it is a torch Linear weight [out, in],
    transposed and reshaped so that the param's first `linear_in_axes` axes are the input
    features (e.g. o_proj [D, N*H] -> [N, H, D]). A block that splits only the leading input or
    output axis (every sharding of `sharding.py`) is a contiguous range of columns or rows.
    """

    linear_in_axes: int = 0

    def hf_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.linear_in_axes:
            return tuple(param_shape)
        split = self.linear_in_axes
        return (math.prod(param_shape[split:]), math.prod(param_shape[:split]))

    def convert(self, tensor: np.ndarray, param_shape: tuple[int, ...]) -> np.ndarray:
        return tensor.T.reshape(param_shape) if self.linear_in_axes else tensor

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


@dataclass(frozen=True)
class Part:
    """Entries `start` .. `start + size - 1` along `axis` of a fused param, filled by one tensor
    whose param is that part with `axis` merged into the axis before it.

    E.g. q_proj is part (2, 0, G) of qkv_proj [D, K, G + 2, H] ([D, K, G, H] merged: [D, N, H]);
    k_proj is part (2, G, 1) ([D, K, 1, H] merged: [D, K, H]).
    """

    axis: int
    start: int
    size: int

    def shape(self, fused_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The unfused param's shape."""
        a = self.axis
        return (*fused_shape[: a - 1], fused_shape[a - 1] * self.size, *fused_shape[a + 1 :])

    def index(self, fused_index: tuple[slice, ...], fused_shape) -> tuple[slice, ...]:
        """The unfused param's block holding the block `fused_index` of the fused param (whose
        `axis` is whole)."""
        a = self.axis
        start, stop, _ = fused_index[a - 1].indices(fused_shape[a - 1])
        merged = slice(start * self.size, stop * self.size)
        return (*fused_index[: a - 1], merged, *fused_index[a + 1 :])


COPY = Layout()
LINEAR = Layout(linear_in_axes=1)
LINEAR_FROM_HEADS = Layout(linear_in_axes=2)


def hf_weights(config: Qwen3Config) -> dict[str, tuple[tuple[str, ...], Layout, Part | None]]:
    """Hugging Face name -> (param path, layout, part of a fused param or None); `{i}` is the
    layer, whose params are under "layers_{i}"."""
    g = config.num_heads // config.num_kv_heads
    attn, mlp, layer = "self_attn", "mlp", "model.layers.{i}"
    qkv, gate_up = ("attn", "qkv_proj"), ("mlp", "gate_up_proj")
    weights = {
        EMBEDDING: (("embed",), COPY, None),
        f"{layer}.input_layernorm.weight": (("attn_norm", "scale"), COPY, None),
        f"{layer}.{attn}.q_proj.weight": (qkv, LINEAR, Part(2, 0, g)),
        f"{layer}.{attn}.k_proj.weight": (qkv, LINEAR, Part(2, g, 1)),
        f"{layer}.{attn}.v_proj.weight": (qkv, LINEAR, Part(2, g + 1, 1)),
        f"{layer}.{attn}.o_proj.weight": (("attn", "o_proj"), LINEAR_FROM_HEADS, None),
        f"{layer}.{attn}.q_norm.weight": (("attn", "q_norm", "scale"), COPY, None),
        f"{layer}.{attn}.k_norm.weight": (("attn", "k_norm", "scale"), COPY, None),
        f"{layer}.post_attention_layernorm.weight": (("mlp_norm", "scale"), COPY, None),
        f"{layer}.{mlp}.gate_proj.weight": (gate_up, LINEAR, Part(1, 0, 1)),
        f"{layer}.{mlp}.up_proj.weight": (gate_up, LINEAR, Part(1, 1, 1)),
        f"{layer}.{mlp}.down_proj.weight": (("mlp", "down_proj"), LINEAR, None),
        "model.norm.weight": (("final_norm", "scale"), COPY, None),
    }
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = (("lm_head",), LINEAR, None)
    return weights


def embedding_as_lm_head(config: Qwen3Config, names) -> bool:
    """Whether the tensors of `names` are of a tied checkpoint that stores its embedding as
    `TIED_EXTRA` alone."""
    return config.tie_word_embeddings and EMBEDDING not in names and TIED_EXTRA in names


@dataclass(frozen=True)
class _Tensor:
    """One expected Hugging Face tensor: where it goes and the shape it must have."""

    param_path: tuple[str, ...]
    layout: Layout
    part: Part | None
    hf_shape: tuple[int, ...]


def safetensors_files(path: Path) -> list[Path]:
    """The shard files of a checkpoint directory (from the index when there is one).

    Raises:
        CheckpointError: an index without a weight_map, or naming each index entry that is
            outside the directory or no file.
    """
    index = path / INDEX_FILE
    if not index.exists():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        return files
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} holds no weight_map (tensor name -> file)")
    names = sorted(set(weight_map.values()))
    root, problems = path.resolve(), []
    for name in names:
        file = path / name
        if not _within(root, file):
            problems.append(f"{INDEX_FILE} names {name!r}, outside {path}")
        elif not file.is_file():
            problems.append(f"{INDEX_FILE} names {name!r}, which is not a file in {path}")
    if problems:
        raise CheckpointError(f"checkpoint {path}:\n  " + "\n  ".join(problems))
    return [path / name for name in names]


def _within(root: Path, file: Path) -> bool:
    """Whether `file` is in the directory `root` once `..` and the links on its way are resolved.

    NOTE: the file itself may link elsewhere: the Hugging Face cache links each file of a
    snapshot to its blob.
    """
    return file.name != ".." and (file.parent.resolve() / file.name).is_relative_to(root)


def expected_tensors(config: Qwen3Config, shapes: Params) -> dict[str, _Tensor]:
    """HF name -> where it goes and its shape, for every tensor of this config."""
    expected, shapes = {}, flatten_dict(shapes)
    for pattern, (path, layout, part) in hf_weights(config).items():
        for i in range(config.num_layers) if "{i}" in pattern else [None]:
            param_path = path if i is None else (f"layers_{i}", *path)
            param_shape = shapes[param_path].shape
            if part is not None:
                param_shape = part.shape(param_shape)
            name = pattern.format(i=i)
            expected[name] = _Tensor(param_path, layout, part, layout.hf_shape(param_shape))
    return expected


def load_hf_checkpoint(
    path: str | Path, dtype: str | None = None, progress: bool = True, mesh: Mesh | None = None
) -> tuple[Qwen3Config, Params]:
    """Reads a Hugging Face Qwen3 directory into device params sharded over the "tp" `mesh`
    (default: the first device alone): returns the config (its dtype the params') and params.

    Args:
        path: directory with config.json and *.safetensors (and, if several, the index).
        dtype: param dtype name; default the checkpoint's.
        progress: show a tqdm bar over the tensors.

    Raises:
        CheckpointError: naming every missing, unmapped, duplicated, mis-shaped or non-float
            tensor, and every index entry outside the directory or missing; a file that is not
            safetensors.
        ValueError: the config.json describes an unsupported model, or one the mesh can't split.
    """
    path = Path(path)
    config = Qwen3Config.from_hf(path, dtype)
    shapes = sharded_param_shapes(config, mesh or make_mesh(1))
    expected, leaves = expected_tensors(config, shapes), flatten_dict(shapes)

    with contextlib.ExitStack() as stack:
        slices = _open_checked(path, config, expected, stack)
        with tqdm(total=len(expected), desc="loading weights", disable=not progress) as bar:
            params = read_params(slices.__getitem__, expected, leaves, bar.update)
    return config, unflatten_dict(params)


def read_params(
    read: Callable[[str], Any],
    expected: dict[str, _Tensor],
    leaves: dict[tuple[str, ...], jax.ShapeDtypeStruct],
    done: Callable[[int], Any] = lambda _: None,
) -> dict[tuple[str, ...], jax.Array]:
    """The params (path -> array) of the `expected` Hugging Face tensors, placed as `leaves`
    (path -> sharded shape) say: each device's block is read into a host buffer of the param's
    dtype and sent before the next is read. `read(name)` is called once a tensor and returns
    what slices as a numpy array does (a safetensors slice, a host array); `done(n)` is called
    after each param, n its number of tensors."""
    by_param: dict[tuple[str, ...], list[str]] = {}
    for name, tensor in expected.items():
        by_param.setdefault(tensor.param_path, []).append(name)
    params = {}
    for param_path, names in by_param.items():
        leaf = leaves[param_path]
        shape, sharding = leaf.shape, leaf.sharding
        sources = {name: read(name) for name in names}
        blocks = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            host = np.empty(sharding.shard_shape(shape), leaf.dtype)
            for name in names:
                _read_into(host, sources[name], expected[name], shape, index)
            # NOTE: waiting bounds host memory to one block even if transfers lag reads.
            blocks.append(jax.device_put(host, device).block_until_ready())
            del host
        params[param_path] = jax.make_array_from_single_device_arrays(shape, sharding, blocks)
        done(len(names))
    return params


def check_hf_checkpoint(path: Path, config: Qwen3Config) -> None:
    """The checks of `load_hf_checkpoint` that read no weight: the index and every tensor's
    name, shape and dtype from the files' headers (CheckpointError as it)."""
    with contextlib.ExitStack() as stack:
        _open_checked(path, config, expected_tensors(config, abstract_params(config)), stack)


def _open_checked(
    path: Path, config: Qwen3Config, expected: dict[str, _Tensor], stack: contextlib.ExitStack
) -> dict[str, Any]:
    """Opens the checkpoint's files in `stack`: tensor name -> its safetensors slice, once every
    expected tensor is found with its shape and a float dtype, and nothing else is.

    Raises:
        CheckpointError: naming every problem (see `load_hf_checkpoint`).
    """
    slices, problems = {}, []
    for file in safetensors_files(path):
        try:
            handle = stack.enter_context(safe_open(file, framework="numpy"))
        except SafetensorError as error:
            raise CheckpointError(f"{file} is not a safetensors file: {error}") from None
        for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            if name in slices:
                problems.append(f"duplicated tensor {name} (in {file.name} and another file)")
            slices[name] = handle.get_slice(name)
    if embedding_as_lm_head(config, slices):
        slices[EMBEDDING] = slices.pop(TIED_EXTRA)
    problems += [f"missing tensor {name}" for name in sorted(expected.keys() - slices.keys())]
    for name in sorted(slices.keys() - expected.keys()):
        if not (name == TIED_EXTRA and config.tie_word_embeddings):
            problems.append(f"unmapped tensor {name}")
    for name, tensor in expected.items():
        if name not in slices:
            continue
        shape, hf_dtype = tuple(slices[name].get_shape()), slices[name].get_dtype()
        if shape != tensor.hf_shape:
            problems.append(f"tensor {name} has shape {shape}, expected {tensor.hf_shape}")
        if hf_dtype not in FLOAT_DTYPES:
            floats = ", ".join(FLOAT_DTYPES)
            problems.append(f"tensor {name} has dtype {hf_dtype}, expected one of {floats}")
    if problems:
        more = len(problems) - MAX_PROBLEMS_SHOWN
        listed = problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more"] if more > 0 else [])
        raise CheckpointError(f"checkpoint {path} does not fit {config}:\n  " + "\n  ".join(listed))
    return slices


def _read_into(
    host: np.ndarray, hf_slice, tensor: _Tensor, shape: tuple[int, ...], index: tuple[slice, ...]
) -> None:
    """Reads the block `index` of the param of global `shape` that `tensor` fills (all of it, or
    its part of a fused param) into `host`, from the checkpoint's slices only."""
    part, layout, target = tensor.part, tensor.layout, host
    if part is not None:
        in_part = [slice(None)] * host.ndim
        in_part[part.axis] = slice(part.start, part.start + part.size)
        target = host[tuple(in_part)]
        shape, index = part.shape(shape), part.index(index, shape)  # the unfused param's
    # NOTE: the unfused block's shape merges two of `target`'s axes: one reshape does both.
    target[...] = layout.convert(hf_slice[layout.hf_index(shape, index)], target.shape)
