"""New weights for a running engine (`LLM.update_params`): checked against the params the
executables were compiled for, and placed as those are, so nothing compiles again. Weights
named as in a Hugging Face checkpoint are laid out as the engine's first (`from_hf_names`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxllm.model.config import Qwen3Config
from jaxllm.model.loader import (
    EMBEDDING,
    TIED_EXTRA,
    embedding_as_lm_head,
    expected_tensors,
    read_params,
)
from jaxllm.model.qwen3 import Params


def _from_torch(tensor: Any) -> Any:
    """A PyTorch tensor (a trainer's state dict or parameters) as numpy: detached, on the CPU,
    floating point as float32 (numpy has no bfloat16; the engine's dtype is float32 at most);
    anything else as it is."""
    if not (hasattr(tensor, "detach") and hasattr(tensor, "cpu")):
        return tensor
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.is_floating_point() else tensor).numpy()


def is_hf_named(params: Any) -> bool:
    """A flat mapping of Hugging Face tensor names ("model.embed_tokens.weight", ...)."""
    return isinstance(params, Mapping) and any("." in str(name) for name in params)


def from_hf_names(named: Mapping[str, Any], config: Qwen3Config, shapes: Params) -> Params:
    """The param tree (structured as `shapes`, the params' sharded shapes) of tensors named as in
    a Hugging Face Qwen3 checkpoint, laid out as a checkpoint's are (q/k/v and gate/up fused,
    linear weights transposed, cast to the model's dtype). A param of host tensors (numpy, torch)
    is read into each device's block as a checkpoint's is, its tensors taken to numpy one param
    at a time; one with a device array among its tensors is converted with jax.numpy where
    that is.

    Raises:
        ValueError: a tensor missing, unknown, of another shape or not floating, naming it.
    """
    expected = expected_tensors(config, shapes)
    if embedding_as_lm_head(config, named):
        named = {**named, EMBEDDING: named[TIED_EXTRA]}  # as `load_hf_checkpoint` reads it
    unknown = sorted(set(named) - set(expected) - {TIED_EXTRA})
    missing = sorted(set(expected) - set(named))
    if unknown or missing:
        raise ValueError(
            f"Hugging Face weights: {'unknown ' + unknown[0] if unknown else 'no ' + missing[0]}"
        )
    for name, tensor in expected.items():
        shape, dtype, floating = _described(named[name])
        if shape != tensor.hf_shape:
            raise ValueError(f"{name} is {list(shape)}; the model's is {list(tensor.hf_shape)}")
        if not floating:
            raise ValueError(f"{name} is {dtype}; weights are floating point")
    flat_shapes = flatten_dict(shapes)
    on_device = {t.param_path for n, t in expected.items() if isinstance(named[n], jax.Array)}
    host = {name: t for name, t in expected.items() if t.param_path not in on_device}
    tree = read_params(lambda name: np.asarray(_from_torch(named[name])), host, flat_shapes)
    fused: dict[tuple[tuple[str, ...], int], list[tuple[int, Any]]] = {}
    for name, tensor in expected.items():
        if name in host:
            continue
        # NOTE: a host array is copied (as in `placed_like`), a device array kept where it is.
        array = _from_torch(named[name])
        array = jnp.asarray(array if isinstance(array, jax.Array) else np.array(array))
        like, part = flat_shapes[tensor.param_path], tensor.part
        shape = like.shape
        if part is not None:  # its part of the fused param: `axis` of size part.size
            shape = (*shape[: part.axis], part.size, *shape[part.axis + 1 :])
        array = tensor.layout.convert(array.astype(like.dtype), shape)
        if part is None:
            tree[tensor.param_path] = array
        else:
            fused.setdefault((tensor.param_path, part.axis), []).append((part.start, array))
    for (path, axis), parts in fused.items():
        parts.sort(key=lambda start_array: start_array[0])
        tree[path] = jnp.concatenate([array for _, array in parts], axis=axis)
    return unflatten_dict(tree)


def _described(tensor: Any) -> tuple[tuple[int, ...], str, bool]:
    """A tensor's shape, dtype and whether it is floating point, read without converting a
    PyTorch tensor or an array (anything else is taken to numpy)."""
    if hasattr(tensor, "is_floating_point") and hasattr(tensor, "detach"):  # PyTorch's
        return tuple(tensor.shape), str(tensor.dtype), tensor.is_floating_point()
    if not (hasattr(tensor, "shape") and hasattr(tensor, "dtype")):
        tensor = np.asarray(tensor)
    return tuple(tensor.shape), str(tensor.dtype), jnp.issubdtype(tensor.dtype, jnp.floating)


def deleted_leaf(params: Params) -> str | None:
    """The name of the first deleted array of `params` (one donated to a computation), or None."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    deleted = (path for path, leaf in leaves if isinstance(leaf, jax.Array) and leaf.is_deleted())
    return next(map(jax.tree_util.keystr, deleted), None)


def placed_like(new: Params, current: Params, donate: bool = False) -> Params:
    """`new` with the tree structure, shapes, dtypes and shardings of `current`: leaves already
    placed as the current ones are used as they are, others are copied to their sharding (on
    the device, for arrays already on the mesh's devices; `donate`: a device array's buffer
    given up to its copy, where jax can reuse it).

    Raises:
        ValueError: another tree structure, a leaf of another shape or dtype, or a deleted
            array, naming the first such leaf.
    """
    new_leaves, new_structure = jax.tree_util.tree_flatten_with_path(new)
    current_leaves, current_structure = jax.tree_util.tree_flatten_with_path(current)
    if new_structure != current_structure:
        names = {jax.tree_util.keystr(path) for path, _ in new_leaves}
        expected = {jax.tree_util.keystr(path) for path, _ in current_leaves}
        missing, unknown = sorted(expected - names), sorted(names - expected)
        detail = f"missing {missing[0]}" if missing else f"unknown {unknown[0]}" if unknown else ""
        raise ValueError(
            f"params have another tree structure than the model's ({detail or 'other nodes'}); "
            "pass a tree like LLM.params"
        )
    if (deleted := deleted_leaf(new)) is not None:
        raise ValueError(f"params{deleted} was deleted (donated?)")
    for (path, leaf), (_, like) in zip(new_leaves, current_leaves, strict=True):
        shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
        if shape != like.shape or dtype != like.dtype:  # NOTE: all checked before any donation
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is {dtype}{list(shape)}; the model's is "
                f"{like.dtype}{list(like.shape)}"
            )
    leaves = []
    for (_, leaf), (_, like) in zip(new_leaves, current_leaves, strict=True):
        if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(like.sharding, leaf.ndim):
            leaves.append(leaf)
        elif isinstance(leaf, jax.Array):
            leaves.append(jax.device_put(leaf, like.sharding, donate=donate))
        else:  # NOTE: copied first: a CPU device may keep the host buffer (`may_alias` or not)
            leaves.append(jax.device_put(np.array(leaf), like.sharding))
    return jax.tree.unflatten(current_structure, leaves)
