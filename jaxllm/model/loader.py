"""Loads a Hugging Face Qwen3 checkpoint (config.json + safetensors shards) into the param tree.

One table, `HF_WEIGHTS`, maps every Hugging Face tensor name to a param path and a layout. All
names and shapes are checked against it before any data is read, and one `CheckpointError`
names every missing, unmapped, duplicated or mis-shaped tensor. Tensors are then read one at a
time through `safe_open` (memory-mapped) into one host buffer per param, which goes to the
device before the next param is read: host memory holds at most one stacked param at a time.

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
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxllm.model.config import Qwen3Config
from jaxllm.model.qwen3 import Params, abstract_params

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: every offending tensor is named."""


@dataclass(frozen=True)
class Layout:
    """How a Hugging Face tensor becomes a param (one layer's slice for stacked params).

    `linear_in_axes == 0` copies the tensor. Otherwise the tensor is a torch Linear weight
    [out, in]: it is transposed and reshaped so that the param's first `linear_in_axes` axes
    are the input features (e.g. q_proj [N*H, D] -> [D, N, H], o_proj [D, N*H] -> [N, H, D]).
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
    path: str | Path, dtype: str | None = None, progress: bool = True
) -> tuple[Qwen3Config, Params]:
    """Reads a Hugging Face Qwen3 directory into device params.

    Args:
        path: directory with config.json and one or many *.safetensors (sharded ones with
            model.safetensors.index.json).
        dtype: param dtype name; default `default_dtype(config)`.
        progress: show a tqdm bar over the tensors.

    Returns:
        The config (its dtype the params') and the param tree.

    Raises:
        CheckpointError: naming every missing, unmapped, duplicated or mis-shaped tensor.
        ValueError: the config.json describes an unsupported model.
    """
    path = Path(path)
    config = Qwen3Config.from_hf(path)
    config = config.replace(dtype=dtype or default_dtype(config))
    shapes = abstract_params(config)
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
                host = np.empty(shape, target_dtype)
                for name in names:
                    _, layer, layout, _ = expected[name]
                    tensor = handles[name].get_tensor(name)
                    if layer is None:
                        host[...] = layout.convert(tensor, shape)
                    else:
                        host[layer] = layout.convert(tensor, shape[1:])
                    del tensor
                    bar.update()
                # NOTE: waiting bounds host memory to one param even if transfers lag reads.
                _set(params, param_path, jax.device_put(host).block_until_ready())
                del host
    return config, params
