"""The device side of the engine: params, the donated KV cache, one executable per bucket.

`ModelRunner` is the only place where the host's numpy batch descriptors meet jax. Every step
goes through an executable compiled ahead of time for the descriptor's bucket `(T, G, S, W)`;
the KV cache is donated to each call, so XLA updates it in place and never copies it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.qwen3 import forward
from jaxllm.model.sampler import SamplingInputs, sample
from jaxllm.sched.batch import BatchDescriptor

logger = logging.getLogger(__name__)

BucketShape = tuple[int, int, int, int]  # (T tokens, G tiles, S sampled rows, W table width)


class CompilationCounter:
    """Counts XLA executables built (or loaded from the persistent cache) in this process."""

    _EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == self._EVENT:
            self.count += 1


# NOTE: one listener per process: JAX offers no way to unregister, so engines share this counter
# and report differences of it.
COMPILATIONS = CompilationCounter()


def _step(
    params, kv_cache: jax.Array, inputs: ModelInputs, sampling: SamplingInputs, *, config
) -> tuple[jax.Array, jax.Array]:
    """One model step and the sampling of its rows: ([S] int32 tokens, the updated cache)."""
    logits, kv_cache = forward(params, config, kv_cache, inputs)
    return sample(logits, sampling), kv_cache


def _abstract_inputs(shape: BucketShape) -> tuple[ModelInputs, SamplingInputs]:
    num_tokens, num_tiles, num_rows, width = shape
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    inputs = ModelInputs(
        token_ids=i32((num_tokens,)),
        positions=i32((num_tokens,)),
        slot_mapping=i32((num_tokens,)),
        block_tables=i32((num_tiles, width)),
        context_lens=i32((num_tiles,)),
        sample_indices=i32((num_rows,)),
    )
    sampling = SamplingInputs(
        temperature=f32((num_rows,)),
        top_k=i32((num_rows,)),
        top_p=f32((num_rows,)),
        min_p=f32((num_rows,)),
        seeds=jax.ShapeDtypeStruct((num_rows,), jnp.uint32),
        steps=i32((num_rows,)),
    )
    return inputs, sampling


def bucket_shape(batch: BatchDescriptor) -> BucketShape:
    num_tiles, width = batch.block_tables.shape
    return (batch.token_ids.shape[0], num_tiles, batch.sample_indices.shape[0], width)


class ModelRunner:
    """Owns the params, the KV cache and the compiled step executables.

    `execute` mutates `kv_cache` (replaces it with the step's in-place-updated buffer).
    """

    def __init__(
        self, config: Qwen3Config, params, *, num_blocks: int, block_size: int
    ) -> None:
        self.config = config
        self.params = params
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache = allocate_kv_cache(config, num_blocks, block_size)
        self._jitted_step = jax.jit(functools.partial(_step, config=config), donate_argnums=(1,))
        self._executables: dict[BucketShape, jax.stages.Compiled] = {}

    @property
    def num_executables(self) -> int:
        return len(self._executables)

    def compile(self, shapes: Iterable[BucketShape], use_tqdm: bool = True) -> None:
        """Compiles (or loads from the persistent cache) one executable per bucket shape."""
        todo = [shape for shape in shapes if shape not in self._executables]
        cache = jax.ShapeDtypeStruct(self.kv_cache.shape, self.kv_cache.dtype)
        for shape in tqdm(todo, desc="Compiling buckets", disable=not use_tqdm or not todo):
            inputs, sampling = _abstract_inputs(shape)
            lowered = self._jitted_step.lower(self.params, cache, inputs, sampling)
            self._executables[shape] = lowered.compile()

    def execute(self, batch: BatchDescriptor) -> jax.Array:
        """Runs one step; returns the sampled tokens [S] as a device array (not yet on host)."""
        shape = bucket_shape(batch)
        executable = self._executables.get(shape)
        if executable is None:
            logger.warning("compiling bucket %s during serving", shape)
            self.compile([shape], use_tqdm=False)
            executable = self._executables[shape]
        inputs = ModelInputs(
            token_ids=batch.token_ids,
            positions=batch.positions,
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            context_lens=batch.context_lens,
            sample_indices=batch.sample_indices,
        )
        sampling = SamplingInputs(
            temperature=batch.temperature,
            top_k=batch.top_k,
            top_p=batch.top_p,
            min_p=batch.min_p,
            seeds=batch.seeds,
            steps=batch.sample_steps,
        )
        tokens, self.kv_cache = executable(self.params, self.kv_cache, inputs, sampling)
        return tokens

    def activation_bytes(self, shape: BucketShape) -> int:
        """Scratch memory XLA needs for one step of this bucket (from a compile, not a run)."""
        cache = jax.ShapeDtypeStruct((self.config.num_layers, 2, 1, self.block_size,
                                      self.config.num_kv_heads, self.config.head_dim),
                                     self.kv_cache.dtype)
        inputs, sampling = _abstract_inputs(shape)
        compiled = self._jitted_step.lower(self.params, cache, inputs, sampling).compile()
        analysis = compiled.memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)


def kv_bytes_per_block(config: Qwen3Config, block_size: int, dtype) -> int:
    """Bytes one KV block takes over all layers (K and V)."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def params_bytes(params) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))


def device_memory_limit() -> int | None:
    """Bytes this process may allocate on the first device, or None where unknown (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def host_array(tokens: jax.Array) -> np.ndarray:
    return np.asarray(jax.device_get(tokens))
