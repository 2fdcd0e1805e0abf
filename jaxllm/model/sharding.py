"""Tensor parallelism: the mesh axis `tp`, the one table from logical axes to it, and shard_map.

Every weight names its axes where the model declares it (`layers.sharded`), and so does the KV
cache (`kv_cache.KV_CACHE_AXES`); `LOGICAL_AXIS_RULES` alone decides which are sharded. The step
runs under `shard_map` (`qwen3.sharded_forward`) over a one-axis mesh, made once (`make_mesh`)
and passed beside the frozen config.

Legend: L layers, D model dim, N query heads, K kv heads, G = N / K, H head dim, F ffn dim,
V vocab, NB blocks, BS block size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.model.config import Qwen3Config

TP_AXIS = "tp"

# Logical axis -> mesh axis (None: replicated on every device).
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "layers": None,  # L (the KV cache)
    "embed": None,  # D
    "heads": TP_AXIS,  # N
    "kv_heads": TP_AXIS,  # K
    "head_dim": None,  # H
    "qkv": None,  # G + 2: a kv head's G query heads, its key and its value
    "gate_up": None,  # 2: gate and up
    "ffn": TP_AXIS,  # F
    "vocab": TP_AXIS,  # V
    "blocks": None,  # NB
    "block_offset": None,  # BS
}


def logical_to_spec(axes: Sequence[str | None]) -> PartitionSpec:
    """The mesh `PartitionSpec` of an array whose axes have these logical names."""
    unknown = [axis for axis in axes if axis is not None and axis not in LOGICAL_AXIS_RULES]
    if unknown:
        raise ValueError(f"logical axes {unknown} are not in LOGICAL_AXIS_RULES")
    return PartitionSpec(*(None if axis is None else LOGICAL_AXIS_RULES[axis] for axis in axes))


def tensor_parallel_size(mesh: Mesh) -> int:
    """Number of devices along the `tp` axis."""
    return mesh.shape[TP_AXIS]


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis ("tp") mesh over the first `tensor_parallel_size` devices; with several
    processes (`jax.distributed.initialize`) every process must own some of them.

    Raises:
        ValueError: fewer devices than `tensor_parallel_size`, or a process left out.
    """
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1 or len(devices) < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices, "
            f"{len(devices)} available (on a CPU, emulate devices with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size})"
        )
    devices = devices[:tensor_parallel_size]
    processes = {device.process_index for device in devices}
    if len(processes) < jax.process_count():
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} leaves out processes: the mesh has "
            f"devices of {len(processes)} of the {jax.process_count()} processes, and every "
            "process runs the same steps on its own devices (docs/multihost.md)"
        )
    return Mesh(np.asarray(devices), (TP_AXIS,))


def check_tensor_parallel(config: Qwen3Config, tensor_parallel_size: int) -> None:
    """Raises a ValueError unless the model's sharded dimensions split evenly over the devices."""
    tp = tensor_parallel_size
    if config.num_heads % tp or config.num_kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide both num_heads ({config.num_heads}) and "
            f"num_kv_heads ({config.num_kv_heads})"
        )
    for name in ("intermediate_size", "vocab_size"):
        size = getattr(config, name)
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {name} ({size})")


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """A copy on every device of the mesh (in its `memory_kind`, e.g. "pinned_host")."""
    return NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind)


def shard_map(
    f: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any
) -> Callable[..., Any]:
    """`jax.shard_map` without the replication check: the outputs are sharded or all-gathered
    (replicated), but jax has no public all-gather typed as such."""
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@contextlib.contextmanager
def gspmd_partitioner() -> Iterator[None]:
    """Within the block, jax lowers (and XLA compiles) for the GSPMD partitioner, not Shardy."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def partitioner_for(mesh: Mesh, custom_calls: bool) -> contextlib.AbstractContextManager:
    """The context to lower and compile a model step over `mesh` in: GSPMD for TP steps that
    call kernels outside XLA, else JAX's default.

    NOTE: XLA's Shardy pass segfaults compiling the TP=2 step with FlashAttention-3's custom
    call (docs/performance.md; `scripts/tp_flash_check.py`).
    """
    if tensor_parallel_size(mesh) > 1 and custom_calls:
        return gspmd_partitioner()
    return contextlib.nullcontext()
