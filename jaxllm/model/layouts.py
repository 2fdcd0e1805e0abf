"""Param tree layouts: layers stacked or one tree each, projections apart or fused.

The model's param tree (qwen3.py) comes in four layouts, all holding the same weights:
- stacked (checkpoints, `load_params`, the layer scan) or one tree per layer, "layers_0" ...
  "layers_{L-1}" (`unstack_layers`, the layer loop);
- q/k/v and gate/up as separate weights (checkpoints) or each as one (`fuse_projections`).
`forward` reads the layout off the tree (`is_stacked`, `is_fused`). Each conversion keeps every
weight's sharding (under tensor parallelism a device's blocks stay on that device) and compiles
once per weight shape, not per layer.

Legend: L layers, D model dim, N query heads, K kv heads, G = N / K, H head dim, F ffn dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

Params = dict[str, Any]


def is_stacked(params: Params) -> bool:
    """Whether the layer params are stacked on an L axis ("layers"), not one tree per layer."""
    return "layers" in params


def unstack_layers(params: Params) -> Params:
    """The param tree with one buffer per layer ("layers_{i}", see the module docstring).

    Moves the layer weights out of `params` (its "layers" entry is removed): each stacked array
    is dropped as soon as it is sliced, so this needs one array's worth of memory more, not the
    model's. Each slice keeps its array's sharding without the L axis.
    """
    if not is_stacked(params):
        return params
    leaves, treedef = jax.tree.flatten(params.pop("layers"))
    num_layers = leaves[0].shape[0]
    slices = []  # per leaf, per layer
    for j in range(len(leaves)):
        stacked, leaves[j] = leaves[j], None
        sharding = stacked.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
        take = _jit(_take_layer, sharding)
        slices.append([take(stacked, i) for i in range(num_layers)])
        del stacked
    unstacked = dict(params)
    for i in range(num_layers):
        unstacked[f"layers_{i}"] = treedef.unflatten([per_layer[i] for per_layer in slices])
    return unstacked


def _take_layer(stacked: jax.Array, i: jax.Array) -> jax.Array:
    return lax.dynamic_index_in_dim(stacked, i, axis=0, keepdims=False)


def is_fused(params: Params) -> bool:
    """Whether q/k/v and gate/up are one weight each (`fuse_projections`)."""
    layer = params["layers"] if is_stacked(params) else params["layers_0"]
    return "qkv_proj" in layer["attn"]


def fuse_projections(params: Params) -> Params:
    """The param tree with q/k/v and gate/up each as one weight, per layer (stacked or not).

    `qkv_proj` [..., D, K, G + 2, H] holds, for each kv head, its G = N / K query heads, its key
    and its value; `gate_up_proj` [..., D, 2, F] gate and up. A step then runs one matmul for
    q/k/v and one for gate/up per layer without concatenating weights (XLA's dot merger would,
    every step). Each fused weight is sharded as its parts: on K, on F. Returns a new tree.
    """
    if is_fused(params):
        return params
    fused = dict(params)
    for name in _layer_trees(params):
        layer = dict(params[name])
        attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
        q, k, v = attn.pop("q_proj"), attn.pop("k_proj"), attn.pop("v_proj")
        attn["qkv_proj"] = _jit(_fuse_qkv, _with_axis_before(k, -1))(q, k, v)
        gate, up = mlp.pop("gate_proj"), mlp.pop("up_proj")
        mlp["gate_up_proj"] = _jit(_fuse_gate_up, _with_axis_before(gate, -1))(gate, up)
        fused[name] = layer | {"attn": attn, "mlp": mlp}
    return fused


def unfuse_projections(params: Params) -> Params:
    """The inverse of `fuse_projections` (q/k/v and gate/up as separate weights again)."""
    if not is_fused(params):
        return params
    unfused = dict(params)
    for name in _layer_trees(params):
        layer = dict(params[name])
        attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
        qkv = attn.pop("qkv_proj")
        part = _without_axis(qkv, -2)
        attn["q_proj"], attn["k_proj"], attn["v_proj"] = _jit(_split_qkv, (part,) * 3)(qkv)
        gate_up = mlp.pop("gate_up_proj")
        part = _without_axis(gate_up, -2)
        mlp["gate_proj"], mlp["up_proj"] = _jit(_split_gate_up, (part,) * 2)(gate_up)
        unfused[name] = layer | {"attn": attn, "mlp": mlp}
    return unfused


def _layer_trees(params: Params) -> list[str]:
    return ["layers"] if is_stacked(params) else [n for n in params if n.startswith("layers_")]


def _fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    *lead, d, n, h = q.shape
    num_kv = k.shape[-2]
    q = q.reshape(*lead, d, num_kv, n // num_kv, h)
    return jnp.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)


def _split_qkv(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    *lead, d, num_kv, g, h = qkv.shape
    g -= 2
    return qkv[..., :g, :].reshape(*lead, d, num_kv * g, h), qkv[..., g, :], qkv[..., g + 1, :]


def _fuse_gate_up(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jnp.stack([gate, up], axis=-2)


def _split_gate_up(gate_up: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gate_up[..., 0, :], gate_up[..., 1, :]


def _with_axis_before(array: jax.Array, axis: int):
    """`array`'s sharding for an array with one more, unsharded, axis before `axis`."""
    return _respec(array, lambda spec: spec.insert(axis % array.ndim, None))


def _without_axis(array: jax.Array, axis: int):
    """`array`'s sharding for an array without its (unsharded) axis `axis`."""
    return _respec(array, lambda spec: spec.pop(axis))


def _respec(array: jax.Array, edit: Callable[[list], object]):
    """`array`'s sharding with its spec (one entry per axis) changed in place by `edit`."""
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = list(sharding.spec) + [None] * (array.ndim - len(sharding.spec))
    edit(spec)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


@functools.cache
def _jit(fn: Callable, out_shardings) -> Callable:
    """`fn` jitted with these out_shardings: one jit per (fn, sharding), so one compile per
    weight shape, not per layer."""
    return jax.jit(fn, out_shardings=out_shardings)


def stack_layers(params: Params) -> Params:
    """The inverse of `unstack_layers`: layer params stacked on a leading L axis."""
    if is_stacked(params):
        return params
    names = sorted(
        (name for name in params if name.startswith("layers_")), key=lambda n: int(n[7:])
    )
    stacked = {name: value for name, value in params.items() if not name.startswith("layers_")}
    stacked["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[n] for n in names))
    return stacked
