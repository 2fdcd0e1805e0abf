"""New weights for a running engine (`LLM.update_params`): checked against the params the
executables were compiled for, and placed as those are, so nothing compiles again."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

Params = Any


def placed_like(new: Params, current: Params) -> Params:
    """`new` with the tree structure, shapes, dtypes and shardings of `current`: leaves already
    placed as the current ones are used as they are, others are copied to their sharding (on
    the device, for arrays already on the mesh's devices).

    Raises:
        ValueError: another tree structure, or a leaf of another shape or dtype, naming the
            first one that differs.
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
    leaves = []
    for (path, leaf), (_, like) in zip(new_leaves, current_leaves, strict=True):
        shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
        if shape != like.shape or dtype != like.dtype:
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is {dtype}{list(shape)}; the model's is "
                f"{like.dtype}{list(like.shape)}"
            )
        if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(like.sharding, leaf.ndim):
            leaves.append(leaf)
        else:
            leaves.append(jax.device_put(leaf, like.sharding))
    return jax.tree.unflatten(current_structure, leaves)
