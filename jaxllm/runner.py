"""The device side of the engine: params, the donated KV cache, executables per bucket.

`ModelRunner` is the only place where the host's numpy batch descriptors meet jax. Every step
runs two executables compiled ahead of time: the model's forward pass for the descriptor's
bucket (`BucketShape`: tokens, tiles, sampled rows, block-table width), which takes the KV cache
donated and so updates it in place, and the sampler for the number of sampled rows and the
variant the host picked (`sampler.sampler_mode`). Splitting the two halves the start-up compile
time (the sampler has far fewer shapes than the model).

Tensor parallelism: the runner holds the "tp" mesh (`jaxllm.model.sharding`). The forward pass
runs under shard_map over it (`sharded_forward`) with params and KV cache sharded; the step's
inputs go to every device, and the logits come back whole on every device, where the sampler
runs replicated. With several processes (`jax.distributed`) every process runs the same steps
and passes the same host arrays; each becomes one global, replicated array.

A step's host arrays travel as two flat int32 arrays, one per executable (`pack`: the model's
seven, the sampler's six, floats and uint32 seeds bit-cast), not as thirteen: each host array
handed to an executable is a transfer of its own (to every device of the mesh), and on the GPU
each costs the host tens of microseconds per step. The steps cut them apart (`unpack`) by the
bucket's static sizes.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from jaxllm.model.attention import Kernels
from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs, SamplingInputs
from jaxllm.model.kv_cache import allocate_kv_cache, kv_cache_specs
from jaxllm.model.qwen3 import COMPILER_OPTIONS, sharded_forward
from jaxllm.model.sampler import SAMPLER_MODES, sample, sampler_mode
from jaxllm.model.sharding import make_mesh, partitioner_for, replicated
from jaxllm.sched.batch import BatchDescriptor, BucketShape

logger = logging.getLogger(__name__)

# Executables compiled at once at start-up.
COMPILE_THREADS = 8


class CompilationCounter:
    """Counts XLA executables built (or loaded from the persistent cache) in this process."""

    _EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()  # start-up compiles on several threads
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == self._EVENT:
            with self._lock:
                self.count += 1


# NOTE: one listener per process: JAX offers no way to unregister one, so engines share this
# counter and report differences of it.
COMPILATIONS = CompilationCounter()


# (name, shape, dtype) of each array in a packed step input.
Layout = tuple[tuple[str, tuple[int, ...], Any], ...]


def model_layout(shape: BucketShape) -> Layout:
    """The forward step's packed inputs: the six `ModelInputs` arrays, then `source_rows`."""
    t, g, w, s = shape.num_tokens, shape.num_tiles, shape.width, shape.num_sampled
    i32 = jnp.int32
    return (
        ("token_ids", (t,), i32),
        ("positions", (t,), i32),
        ("slot_mapping", (t,), i32),
        ("block_tables", (g, w), i32),
        ("context_lens", (g,), i32),
        ("sample_indices", (s,), i32),
        ("source_rows", (t,), i32),
    )


def sampling_layout(num_rows: int) -> Layout:
    """The sampler's packed inputs: the `SamplingInputs` fields."""
    return (
        ("temperature", (num_rows,), jnp.float32),
        ("top_k", (num_rows,), jnp.int32),
        ("top_p", (num_rows,), jnp.float32),
        ("min_p", (num_rows,), jnp.float32),
        ("seeds", (num_rows,), jnp.uint32),
        ("steps", (num_rows,), jnp.int32),
    )


def _packed_size(layout: Layout) -> int:
    return sum(math.prod(shape) for _, shape, _ in layout)


def pack(layout: Layout, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """`arrays` by name (each of `layout`'s shape and dtype) as one flat int32 array."""
    if set(arrays) != {name for name, _, _ in layout}:
        raise ValueError(f"arrays {sorted(arrays)} are not the layout's")
    parts = []
    for name, shape, dtype in layout:
        array = np.asarray(arrays[name])
        want = np.dtype(dtype)
        if array.shape != shape or array.dtype != want:
            raise ValueError(f"{name}: {array.dtype}{list(array.shape)}, not {want}{list(shape)}")
        parts.append(array.reshape(-1).view(np.int32))
    return np.concatenate(parts)


def unpack(layout: Layout, packed: jax.Array) -> dict[str, jax.Array]:
    """The inverse of `pack`, traced: the arrays by name."""
    arrays, offset = {}, 0
    for name, shape, dtype in layout:
        size = math.prod(shape)
        part = packed[offset : offset + size].reshape(shape)
        arrays[name] = part if dtype == jnp.int32 else lax.bitcast_convert_type(part, dtype)
        offset += size
    return arrays


def _model_inputs(shape: BucketShape, sharding: NamedSharding) -> ModelInputs:
    """The `ModelInputs` of a bucket, unpacked, as shapes."""
    return ModelInputs(
        **{
            name: jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)
            for name, dims, dtype in model_layout(shape)
            if name != "source_rows"
        }
    )


def _packed(layout: Layout, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((_packed_size(layout),), jnp.int32, sharding=sharding)


def _forward_step(forward_fn, params, kv_cache, packed, previous_tokens, *, shape: BucketShape):
    """The model step, its placeholder token ids first replaced by the previous step's samples.

    The host schedules step N+1 before it has read step N's tokens (`Scheduler.commit`); rows
    whose input is such a token name its row in `previous_tokens` in `source_rows`.
    """
    arrays = unpack(model_layout(shape), packed)
    source_rows = arrays.pop("source_rows")
    inputs = ModelInputs(**arrays)
    from_previous = previous_tokens[jnp.maximum(source_rows, 0)]  # [T]
    token_ids = jnp.where(source_rows >= 0, from_previous, inputs.token_ids)
    return forward_fn(params, kv_cache, inputs._replace(token_ids=token_ids))


def _sample_step(logits, packed, *, num_rows: int, mode: str):
    """Samples [S] tokens, padded to `num_rows`, so every step's result has one shape."""
    sampling = SamplingInputs(**unpack(sampling_layout(logits.shape[0]), packed))
    tokens = sample(logits, sampling, mode=mode)
    return jnp.pad(tokens, (0, num_rows - tokens.shape[0]))


def _compile_all(programs: dict[Any, jax.stages.Lowered], bar: tqdm) -> dict[Any, Any]:
    """Compiles lowered programs (or loads them from the persistent cache) a few at a time on
    threads, as JAX allows and JetStream's AOT warm-up does: XLA's compiler releases the GIL,
    and most of one compile is single-threaded. Ticks `bar` as each is done."""
    workers = min(COMPILE_THREADS, len(programs), os.cpu_count() or 1)
    if workers <= 1:
        compiled = {}
        for key, program in programs.items():
            compiled[key] = program.compile()
            bar.update(1)
        return compiled
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(program.compile): key for key, program in programs.items()}
        compiled = {}
        for future in concurrent.futures.as_completed(futures):
            compiled[futures[future]] = future.result()
            bar.update(1)
    return compiled


def step_scratch_bytes(
    config: Qwen3Config,
    params,
    shape: BucketShape,
    block_size: int,
    mesh: Mesh,
    kernels: Kernels,
) -> int | None:
    """Device memory one step of `shape` needs beside the params and the KV cache (per device).

    Measured by compiling the step over a one-block cache: XLA's own account of the step's
    temporary buffers, plus its logits output. None where the backend gives no account.
    """
    forward = jax.jit(
        sharded_forward(config, mesh, kernels),
        donate_argnums=1,
        compiler_options=COMPILER_OPTIONS,
    )
    cache = jax.eval_shape(lambda: allocate_kv_cache(config, 1, block_size))
    cache = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        cache,
        kv_cache_specs(),
    )
    with partitioner_for(mesh, kernels.custom_calls):
        compiled = forward.lower(params, cache, _model_inputs(shape, replicated(mesh))).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    logits = shape.num_sampled * config.vocab_size * 4
    return int(analysis.temp_size_in_bytes) + 2 * logits


class ModelRunner:
    """Owns the params, the KV cache and the compiled executables.

    Args:
        config: the model.
        params: the param tree, sharded over `mesh` (`load_params(..., mesh=mesh)`).
        num_blocks, block_size: the KV cache's capacity.
        max_sampled_rows: the most sampled rows of any bucket: every step returns this many.
        mesh: the "tp" mesh (`sharding.make_mesh`); default the first device alone.

    `execute` mutates `kv_cache`: it is replaced by the step's in-place-updated buffer.
    """

    def __init__(
        self,
        config: Qwen3Config,
        params,
        *,
        num_blocks: int,
        block_size: int,
        max_sampled_rows: int,
        kernels: Kernels,
        mesh: Mesh | None = None,
    ) -> None:
        self.config = config
        self.kernels = kernels
        self.params = params
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.mesh = mesh or make_mesh(1)
        self._replicated = replicated(self.mesh)
        self.max_sampled_rows = max_sampled_rows
        self._forward = jax.jit(
            functools.partial(
                _forward_step,
                sharded_forward(config, self.mesh, kernels),
            ),
            static_argnames="shape",
            donate_argnums=1,
            compiler_options=COMPILER_OPTIONS,
        )
        self._sample = jax.jit(
            functools.partial(_sample_step, num_rows=max_sampled_rows),
            static_argnames="mode",
            out_shardings=self._replicated,
        )
        # NOTE: what the first step reads as "the previous step's tokens" (it reads none).
        self._no_tokens = jax.device_put(np.zeros(max_sampled_rows, np.int32), self._replicated)
        self.kv_cache = allocate_kv_cache(config, num_blocks, block_size, mesh=self.mesh)
        self._forward_executables: dict[BucketShape, jax.stages.Compiled] = {}
        # (sampled rows, sampler mode) -> executable
        self._sample_executables: dict[tuple[int, str], jax.stages.Compiled] = {}

    @property
    def num_executables(self) -> int:
        return len(self._forward_executables) + len(self._sample_executables)

    def sampler_mode(self, batch: BatchDescriptor) -> str:
        """The sampler variant the step of `batch` runs (chosen on the host)."""
        return sampler_mode(
            batch.temperature, batch.top_k, batch.top_p, batch.min_p, self.config.vocab_size
        )

    def compile(
        self,
        shapes: Iterable[BucketShape],
        use_tqdm: bool = True,
        sampler_modes: Iterable[str] = SAMPLER_MODES,
    ) -> None:
        """Compiles (or loads from the persistent cache) the executables of these buckets: the
        model's, and the sampler's in each of `sampler_modes`."""
        shapes, sampler_modes = list(shapes), tuple(sampler_modes)
        samplers = sorted(
            {(shape.num_sampled, mode) for shape in shapes for mode in sampler_modes}
            - set(self._sample_executables)
        )
        shapes = [shape for shape in shapes if shape not in self._forward_executables]
        cache = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.kv_cache
        )
        logits_dtype = jnp.float32
        with tqdm(
            total=len(shapes) + len(samplers),
            desc="Compiling buckets",
            disable=not use_tqdm or not shapes,
        ) as bar:
            sampler_programs = {}
            for num_rows, mode in samplers:
                logits = jax.ShapeDtypeStruct(
                    (num_rows, self.config.vocab_size), logits_dtype, sharding=self._replicated
                )
                sampling = _packed(sampling_layout(num_rows), self._replicated)
                sampler_programs[num_rows, mode] = self._sample.lower(logits, sampling, mode=mode)
            self._sample_executables |= _compile_all(sampler_programs, bar)
            previous = jax.ShapeDtypeStruct(
                (self.max_sampled_rows,), jnp.int32, sharding=self._replicated
            )
            # NOTE: the steps are compiled under the partitioner they were lowered for.
            with partitioner_for(self.mesh, self.kernels.custom_calls):
                forward_programs = {}
                for shape in shapes:
                    inputs = _packed(model_layout(shape), self._replicated)
                    forward_programs[shape] = self._forward.lower(
                        self.params, cache, inputs, previous, shape=shape
                    )
                self._forward_executables |= _compile_all(forward_programs, bar)

    def warm_up(self) -> None:
        """Runs every compiled executable once, on a step of padding alone, and waits for them.

        The first run of an executable pays for loading its kernels and building its CUDA
        command buffers; without a warm-up that falls on the first requests' steps (vLLM
        captures its CUDA graphs at start-up for the same reason). On an H200 it takes 0.7-0.9 s;
        without it bench.py's prefill (its first 0.3 s) ran at 280-430k tokens/s instead of
        457k, slowest when the executables came from the persistent cache (docs/performance.md).
        Padding rows write nothing (slot -1) and padding tiles attend to nothing (context 0),
        as in every padded step, so the cache is left as it was.
        """
        logits_by_rows = {}
        for shape in self._forward_executables:
            padding = {
                name: np.full(dims, -1 if name in ("slot_mapping", "source_rows") else 0, dtype)
                for name, dims, dtype in model_layout(shape)
            }
            logits_by_rows[shape.num_sampled] = self._run_forward(shape, padding, self._no_tokens)
        results = [self.kv_cache]
        for num_rows, mode in self._sample_executables:
            greedy = SamplingInputs.padding(num_rows)._asdict()
            results.append(self._run_sampler(num_rows, mode, logits_by_rows[num_rows], greedy))
        jax.block_until_ready(results)

    def execute(
        self,
        batch: BatchDescriptor,
        previous_tokens: jax.Array | None = None,
        source_rows: np.ndarray | None = None,
    ) -> jax.Array:
        """Dispatches one step; returns its sampled tokens without waiting for them.

        Args:
            batch: the step's descriptor.
            previous_tokens: [max_sampled_rows] the previous step's result (a device array),
                from which rows holding a placeholder token take their input.
            source_rows: [T] the row of `previous_tokens` each token row takes, or -1 to keep
                its own token id.

        Returns:
            [max_sampled_rows] int32 sampled tokens on the device; rows past the bucket's
            sampled rows are 0.
        """
        shape = batch.shape
        mode = self.sampler_mode(batch)
        if shape not in self._forward_executables or (
            (shape.num_sampled, mode) not in self._sample_executables
        ):
            logger.warning("compiling bucket %s (sampler %s) while serving", shape, mode)
            self.compile([shape], use_tqdm=False, sampler_modes=[mode])
        if previous_tokens is None:
            previous_tokens = self._no_tokens
        if source_rows is None:
            source_rows = np.full(shape.num_tokens, -1, np.int32)
        model_arrays = batch.model_inputs() | {"source_rows": source_rows}
        logits = self._run_forward(shape, model_arrays, previous_tokens)
        sampling_arrays = {
            "temperature": batch.temperature,
            "top_k": batch.top_k,
            "top_p": batch.top_p,
            "min_p": batch.min_p,
            "seeds": batch.seeds,
            "steps": batch.sample_steps,
        }
        return self._run_sampler(shape.num_sampled, mode, logits, sampling_arrays)

    def _run_forward(
        self, shape: BucketShape, arrays: Mapping[str, np.ndarray], previous_tokens: jax.Array
    ) -> jax.Array:
        """Dispatches the bucket's model step on `arrays` (`model_layout`); returns its logits
        and keeps the step's updated cache."""
        inputs = pack(model_layout(shape), arrays)
        if jax.process_count() > 1:
            inputs = self._global(inputs)
        logits, self.kv_cache = self._forward_executables[shape](
            self.params, self.kv_cache, inputs, previous_tokens
        )
        return logits

    def _run_sampler(
        self, num_rows: int, mode: str, logits: jax.Array, arrays: Mapping[str, np.ndarray]
    ) -> jax.Array:
        """Dispatches the sampler of `num_rows` rows in `mode` on `arrays` (`sampling_layout`)."""
        sampling = pack(sampling_layout(num_rows), arrays)
        if jax.process_count() > 1:
            sampling = self._global(sampling)
        return self._sample_executables[num_rows, mode](logits, sampling)

    def _global(self, tree: Any) -> Any:
        """Host arrays (equal in every process) as global arrays replicated over the mesh."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self._replicated, x), tree
        )
