"""The device side of the engine: params, the donated KV cache, executables per bucket.

`ModelRunner.execute(plan)` is the only place where the host's numpy plans meet jax. A step runs
two executables compiled ahead of time (the programs of `jaxllm.steps`): the forward pass of the
plan's bucket (KV cache donated, so updated in place) and the sampler in the variant the host
picked (`sampler.sampler_mode`); kept apart, the sampler needs far fewer shapes, halving start-up
compiles. A plan of several decode steps runs both in one executable, per sampler variant. Under
tensor parallelism the forward pass runs in shard_map over the "tp" mesh, the sampler replicated;
with several processes (`jax.distributed`) each runs the same steps on the same host arrays.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxllm import steps
from jaxllm.executables import ExecutableStore, depends_on
from jaxllm.handoff import Mailbox, StepwiseMasks
from jaxllm.model.attention import Kernels
from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import SamplingInputs
from jaxllm.model.kv_cache import (
    KVCache,
    allocate_above_a_gap,
    allocate_kv_cache,
    gap_bytes,
    kv_cache_shapes,
)
from jaxllm.model.logits_processors import LogitsProcessors
from jaxllm.model.qwen3 import DEFAULT_OPTIMIZATION, Params, sharded_forward
from jaxllm.model.sampler import ONE_PASS_MODES, SAMPLER_MODES, STARTUP_SAMPLER_MODES, sampler_mode
from jaxllm.model.sharding import partitioner_for, replicated
from jaxllm.sched import Bucket, StepPlan
from jaxllm.steps import FixedInputs, StepResult, pack, padding_step, previous_rows
from jaxllm.weights import from_hf_names, is_hf_named, placed_like

logger = logging.getLogger(__name__)

# NOTE: XLA's compiler releases the GIL and most of one compile is single-threaded, so start-up
# compiles this many executables at once on threads (as JetStream's AOT warm-up does).
COMPILE_THREADS = 8


class ModelRunner:
    """Owns the params, the KV cache and the compiled executables. It starts with neither params
    (`update_params`) nor cache (`wake_up`): its programs compile from the shapes of both.

    Args:
        config: the model.
        param_shapes: the param tree's shapes, sharded over `mesh` (`sharded_param_shapes`).
        kernels: the attention kernels (`jaxllm.platform`).
        mesh: the "tp" mesh (`sharding.make_mesh`).
        num_blocks, block_size: the KV cache's capacity.
        max_sampled_rows: the most sampled rows of any bucket: every step returns this many.
        max_logprobs: the top tokens whose logprobs a step with logprobs returns.
        processed_logprobs: logprobs of the logits each row samples from (after penalties,
            temperature and filters), not of the model's raw logits.
        num_processor_slots: the logits processors' slots (`model.logits_processors`).
        processor_rows: the sampled rows of the buckets whose logits processing the first
            request that asks for it compiles all at once (empty: as steps need them).

    Mutates: `execute` replaces `kv_cache` by the step's in-place-updated buffer; `compile`
    adds executables; `reset` forgets the steps in flight.
    """

    def __init__(
        self,
        config: Qwen3Config,
        param_shapes: Params,
        *,
        kernels: Kernels,
        mesh: Mesh,
        num_blocks: int,
        block_size: int,
        max_sampled_rows: int,
        max_logprobs: int = 20,
        processed_logprobs: bool = False,
        num_processor_slots: int = 1,
        processor_rows: tuple[int, ...] = (),
        executables: ExecutableStore | None = None,
    ) -> None:
        self.config = config
        self.params: Params | None = None
        self._param_shapes = param_shapes
        self.kernels, self.mesh = kernels, mesh
        self.max_sampled_rows = max_sampled_rows
        self._processed_logprobs = processed_logprobs
        self._replicated = replicated(mesh)
        self.mailbox = Mailbox.of(kernels, mesh, config.vocab_size)
        self._forward, self._decode_steps, self._logprobs, self._sample = steps.programs(
            sharded_forward(config, mesh, kernels), mesh, kernels, max_sampled_rows,
            min(max_logprobs, config.vocab_size), processed_logprobs, self.mailbox,
        )  # fmt: skip
        # NOTE: what the first step reads as "the previous step's tokens" (it reads none).
        self._no_tokens = jax.device_put(np.zeros(max_sampled_rows, np.int32), self._replicated)
        self._previous: tuple[StepPlan, jax.Array] | None = None
        self._fixed = FixedInputs(self._replicated, self._on_devices, kernels.fixed_inputs)
        self._dispatcher = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-dispatch")
        self.processors = LogitsProcessors(
            num_processor_slots, config.vocab_size, self._replicated, self._on_devices,
            processor_rows, max_sampled_rows,
        )  # fmt: skip
        self._allocate = jax.jit(
            functools.partial(allocate_kv_cache, config, num_blocks, block_size, mesh=mesh)
        )
        self.kv_cache: KVCache | None = None
        self._cache_shapes = kv_cache_shapes(config, num_blocks, block_size, mesh)
        self._forward_executables: dict[Bucket, jax.stages.Compiled] = {}
        # by (bucket, sampler mode, whether each step's masks come from the mailbox)
        self._multi_step_executables: dict[tuple[Bucket, str, bool], jax.stages.Compiled] = {}
        self._logprob_executables: dict[int, jax.stages.Compiled] = {}  # by sampled rows
        self._sample_executables: dict[tuple[int, str], jax.stages.Compiled] = {}  # and mode
        # NOTE: what the model's programs depend on besides their arguments (`depends_on`)
        self._settings = (config, kernels, max_sampled_rows)
        self.executables = executables or ExecutableStore()  # none: every program compiled
        self.ladder: tuple[Bucket, ...] = ()  # compiled at start-up; none: at first use

    def _allocate_kv_cache(self) -> Any:
        gap = gap_bytes(self.max_sampled_rows, self.config.vocab_size)
        return allocate_above_a_gap(self._allocate, gap, self._replicated)

    def reset(self) -> None:
        """Forgets the steps dispatched so far; awake, allocates the KV cache again, empty (a
        failed step may have deleted it by donation, or left it in an error state)."""
        awake, self._previous = self.kv_cache is not None, None
        self._fixed.reset()
        self.kv_cache = None  # NOTE: freed before its successor is allocated
        self.processors.reset()
        if self.mailbox is not None:
            self.mailbox.reset()
        self.kv_cache = self._allocate_kv_cache() if awake else None

    def update_params(self, params: Params, donate: bool = False) -> None:
        """Takes new weights, placed as the old (`placed_like`); HF-named ones converted first."""
        if is_hf_named(params):
            params = from_hf_names(params, self.config, self._param_shapes)
        self.params = placed_like(params, self.params or self._param_shapes, donate)

    def sleep(self, weights: bool = False) -> None:
        """Frees the KV cache (and drops the weights, with `weights`); `wake_up` allocates it
        again. Nothing compiled is lost."""
        jax.tree.map(lambda array: array.delete(), self.kv_cache)
        self.kv_cache = None
        self.reset()  # asleep: allocates nothing
        if weights:
            self.params = None

    def wake_up(self) -> None:
        if self.kv_cache is None:
            self.kv_cache = self._allocate_kv_cache()

    @property
    def num_executables(self) -> int:
        tables = self._forward_executables, self._sample_executables, self._logprob_executables
        tables += self._multi_step_executables, self._fixed.executables
        return sum(map(len, tables))

    def compile(
        self,
        buckets: Iterable[Bucket],
        use_tqdm: bool = True,
        sampler_modes: Iterable[str] = SAMPLER_MODES,
        logprobs: bool = True,
        mailbox: bool = False,
    ) -> None:
        """Compiles (or loads from the persistent cache) the executables of these buckets: the
        model's, the sampler's in each of `sampler_modes` and (with `logprobs`) the logprobs',
        or for a bucket of several decode steps, one of model and sampler per sampler mode
        (with `mailbox`, only their variants that take each step's masks from the mailbox);
        `COMPILE_THREADS` at a time."""
        buckets, sampler_modes = list(buckets), tuple(sampler_modes)
        single = [bucket for bucket in buckets if bucket.num_steps == 1 and not mailbox]
        multi = [bucket for bucket in buckets if bucket.num_steps > 1]
        rows, logprobs = sorted({bucket.num_sampled for bucket in single}), logprobs and not mailbox
        shape = functools.partial(jax.ShapeDtypeStruct, sharding=self._replicated)

        def packed(arrays: Iterable[np.ndarray]) -> jax.ShapeDtypeStruct:  # as `pack` packs them
            return shape((sum(map(np.size, arrays)),), jnp.int32)

        logits = {n: shape((n, self.config.vocab_size), jnp.float32) for n in rows}
        params, cache, no_tokens = self._param_shapes, self._cache_shapes, self._no_tokens
        options = self.kernels.compiler_options
        # (executables, key, lowering, compiler options): the model's first, as their compiles
        # take the longest
        programs = [
            (self._forward_executables, bucket, functools.partial(
                self._forward.lower, params, cache, packed(padding_step(bucket)), no_tokens,
                bucket=bucket,
            ), options(bucket.num_tokens))
            for bucket in single
        ] + [
            (self._multi_step_executables, (bucket, mode, mailbox), functools.partial(
                self._decode_steps.lower, params, cache, packed(padding_step(bucket)),
                packed(bucket.padding()[1]), no_tokens,
                self.mailbox.shapes(bucket.num_sampled) if mailbox else None,
                bucket=bucket, mode=mode,
            ), options(bucket.num_tokens, loop=True))
            for bucket in multi for mode in sampler_modes
        ] + [
            (self._logprob_executables, n, functools.partial(
                self._logprobs.lower, logits[n],
                shape((self.max_sampled_rows,), jnp.int32),
                packed((np.zeros(n, np.int32), *SamplingInputs.padding(n))),
            ), options(n))
            for n in (rows if logprobs else ())
        ] + [
            (self._sample_executables, (n, mode), functools.partial(
                self._sample.lower, logits[n], packed(SamplingInputs.padding(n)),
                shape((n, self.processors.mask_words), jnp.int32), mode=mode,
            ), options(n) | (DEFAULT_OPTIMIZATION if mode in ONE_PASS_MODES else {}))
            for n in rows for mode in sampler_modes
        ] + [
            (self._fixed.executables, (n, m), functools.partial(
                self._fixed.write.lower, (shape((n,), jnp.int32), shape((m,), jnp.int32),
                no_tokens), shape((n + m,), jnp.int32), no_tokens
            ), {})
            for n, m in {
                (steps.packed_size(bucket), steps.settings_size(bucket.num_sampled))
                for bucket in single if self._fixed.enabled
            }
        ]  # fmt: skip
        programs = [program for program in programs if program[1] not in program[0]]

        def keyed(program: tuple) -> tuple[str, functools.partial, dict]:
            *_, lower, options = program
            closed = depends_on(lower.func.__self__, self._settings, self.mesh)
            return self.executables.key(closed, lower.args, lower.keywords, options), lower, options

        def done(index: int, executable: jax.stages.Compiled) -> None:
            table, key = programs[index][:2]
            table[key] = executable
            bar.update(1)

        total = len(programs)
        threads = max(1, min(COMPILE_THREADS, total, os.cpu_count() or 1))
        # NOTE: lowered under the partitioner the steps need; keyed as each is handed on (`map`)
        with (
            tqdm(total=total, desc="Compiling buckets", disable=not use_tqdm or not total) as bar,
            partitioner_for(self.mesh, self.kernels.custom_calls),
        ):
            self.executables.build(map(keyed, programs), threads, done)

    def compile_ladder(self, buckets: Iterable[Bucket]) -> None:
        """Compiles every bucket a step can have (the ladder), with the samplers of
        `STARTUP_SAMPLER_MODES` and no logprobs."""
        self.ladder = tuple(buckets)
        self.compile(self.ladder, sampler_modes=STARTUP_SAMPLER_MODES, logprobs=False)

    def _compile_for(self, bucket: Bucket, mode: str, logprobs: bool, mailbox: bool) -> None:
        """Compiles what a step of `bucket` lacks; for the whole ladder if `bucket` is in it.
        Each new mailbox program runs once, on padding, as `warm_up` runs the others."""
        buckets = self.ladder if bucket in self.ladder else (bucket,)
        if buckets is self.ladder:
            logger.info("compiling sampler %s, logprobs %s, for the ladder", mode, logprobs)
        elif self.ladder:
            logger.warning("compiling bucket %s (sampler %s) while serving", bucket, mode)
        # NOTE: compiling and a program's first run load kernels, which may wait for the device
        # to idle: not while a plan waits on the device for its masks from the host (`handoff`)
        jax.block_until_ready(self.kv_cache)
        compiled = set(self._multi_step_executables)
        self.compile(buckets, False, sampler_modes=[mode], logprobs=logprobs, mailbox=mailbox)
        new, vocab_size = set(self._multi_step_executables) - compiled, self.config.vocab_size
        for warm, warm_mode, _ in new if mailbox else ():
            stepwise = StepwiseMasks(StepPlan([], [], [], [], warm, None, None), vocab_size)
            stepwise.ready.set()  # no grammars: every step lets every token through
            step = (padding_step(warm), warm.padding()[1], stepwise.first(), self._no_tokens)
            tokens, _, kept = self._run_steps(warm, warm_mode, *step, stepwise)
            np.asarray(tokens), kept.result()  # a failed program raises in the first

    def warm_up(self) -> None:
        """Runs every compiled executable once, on a step of padding alone, and waits for them.

        NOTE: a first run loads the executable's kernels and builds its CUDA command buffers: a
        cost kept off the first requests (as vLLM captures its CUDA graphs at start-up). Padding
        writes and attends to nothing (slot -1, context 0): the cache is unchanged.
        """
        forwards = {}  # sampled rows -> logits, greedy settings
        for bucket in self._forward_executables:
            host = (pack(padding_step(bucket)), pack(SamplingInputs.padding(bucket.num_sampled)))
            forwards[bucket.num_sampled] = self._run_forward(bucket, host, self._no_tokens)
        results = [self._run_sampler(n, mode, *forwards[n]) for n, mode in self._sample_executables]
        for bucket, mode, mailbox in self._multi_step_executables:
            if not mailbox:  # mailbox programs run as they are compiled (`_compile_for`)
                step = (padding_step(bucket), bucket.padding()[1], None, self._no_tokens, None)
                results.append(self._run_steps(bucket, mode, *step)[0])
        jax.block_until_ready([*results, self.kv_cache])  # the cache last: each step donates it

    def execute(
        self, plan: StepPlan, masks: Callable | None = None, stepwise: Any = None
    ) -> StepResult:
        """Dispatches one step; returns its sampled tokens (and logprobs, if the plan asks)
        without waiting for them. `masks`, for a plan with constrained rows, gives the sampled
        rows' token bitmask: for one step, called with the future of `_run_forward`'s result
        while it is dispatched (the host's work in it overlaps the dispatch and the device's);
        for several (with `stepwise`: the runner has a mailbox), with None before the dispatch:
        the first step's (None: from `stepwise` too), the later ones' from `stepwise`."""
        bucket, sampling = plan.bucket, plan.sampling
        mode = sampler_mode(*sampling[:4], self.config.vocab_size)  # temperature .. min_p
        if not self._has_executables(bucket, mode, plan.logprobs, stepwise is not None):
            self._compile_for(bucket, mode, plan.logprobs, stepwise is not None)
        previous_plan, previous_tokens = self._previous or (None, self._no_tokens)
        arrays = (*plan.inputs, previous_rows(plan, previous_plan))
        logprobs = kept = None
        if bucket.num_steps > 1:
            arrays, bitmask = (*arrays, plan.step_slots), masks and masks(None)
            step = (bucket, mode, arrays, sampling, bitmask, previous_tokens, stepwise)
            tokens, last, kept = self._run_steps(*step)
        else:
            host = (pack(arrays), pack(sampling))
            logits, settings, bitmask = self._dispatch_forward(bucket, host, previous_tokens, masks)
            if bitmask is not None and (plan.processors is not None or plan.logprobs):
                # NOTE: processors and raw logprobs read the masked logits, as vLLM's
                logits, bitmask = self.processors.mask(logits, bitmask, donate=True), None
            processed = logits
            if plan.processors is not None:
                donate = not plan.logprobs or self._processed_logprobs  # raw ones read them
                processed, rows = self.processors.apply(logits, plan.processors, donate)
            last, tokens = self._run_sampler(bucket.num_sampled, mode, processed, settings, bitmask)
            if plan.processors is not None:
                self.processors.count(rows, last)
            if plan.logprobs:
                packed = self._on_devices(pack((plan.logprob_targets, *sampling)))
                logits = processed if self._processed_logprobs else logits
                logprobs = self._logprob_executables[bucket.num_sampled](logits, last, packed)
        self._previous = (plan, last)
        return StepResult(tokens, logprobs, kept)

    def _has_executables(self, bucket: Bucket, mode: str, logprobs: bool, mailbox: bool) -> bool:
        if bucket.num_steps > 1:
            return (bucket, mode, mailbox) in self._multi_step_executables
        return (
            bucket in self._forward_executables
            and (bucket.num_sampled, mode) in self._sample_executables
            and (not logprobs or bucket.num_sampled in self._logprob_executables)
        )

    def _run_steps(
        self, bucket: Bucket, mode: str, arrays, sampling, bitmask, previous_tokens, stepwise
    ) -> tuple[jax.Array, jax.Array, concurrent.futures.Future | None]:
        """Dispatches a plan of several decode steps (`arrays` and `sampling` its host inputs),
        with `stepwise` each under its own token mask (`Mailbox`; `bitmask` the first step's, or
        None); keeps its cache; returns every step's tokens (in host memory), the last's, and
        with `stepwise` the future of the kept ones."""
        mailbox = stepwise and self.mailbox.open(bitmask, bucket.num_steps, stepwise)
        packed = (self._on_devices(pack(arrays)), self._on_devices(pack(sampling)))
        tokens, last, self.kv_cache = self._multi_step_executables[bucket, mode, bool(mailbox)](
            self.params, self.kv_cache, *packed, previous_tokens, mailbox
        )
        return tokens, last, None if mailbox is None else self.mailbox.follow()

    def _dispatch_forward(
        self, bucket: Bucket, host: tuple[np.ndarray, np.ndarray], previous_tokens, masks
    ) -> tuple[jax.Array, jax.Array | np.ndarray, np.ndarray | None]:
        """`_run_forward`'s logits and settings, and the bitmask `masks` gives (None without
        `masks`). NOTE: on a GPU the forward call holds its thread ~1 ms (mostly its CUDA graph's
        launch) with the GIL released: on a thread of its own, it overlaps the masks' host work."""
        if masks is None:
            return *self._run_forward(bucket, host, previous_tokens), None
        forward = self._dispatcher.submit(self._run_forward, bucket, host, previous_tokens)
        try:
            bitmask = masks(forward)
        finally:  # it replaces `kv_cache`: done before anything else (a reset) touches that
            concurrent.futures.wait([forward])
        return *forward.result(), bitmask

    def _run_forward(
        self, bucket: Bucket, host: tuple[np.ndarray, np.ndarray], previous_tokens: jax.Array
    ) -> tuple[jax.Array, jax.Array | np.ndarray]:
        """Dispatches the bucket's model step (`host`: its packed inputs, its sampler's packed
        settings); keeps its updated cache, returns its logits and the settings as the sampler
        takes them (`FixedInputs`)."""
        packed, settings, previous_tokens = self._fixed(*host, previous_tokens)
        logits, self.kv_cache = self._forward_executables[bucket](
            self.params, self.kv_cache, packed, previous_tokens
        )
        return logits, settings

    def _run_sampler(
        self, rows: int, mode: str, logits, settings, bitmask: np.ndarray | None = None
    ) -> tuple[jax.Array, jax.Array]:  # the tokens on the devices, and in host memory
        bitmask = self.processors.bitmask(rows, bitmask)
        return self._sample_executables[rows, mode](logits, settings, bitmask)

    def _on_devices(self, packed: np.ndarray) -> np.ndarray | jax.Array:
        """A packed host array (equal in every process) as the executables take it: as it is
        with one process, a global array replicated over the mesh with several."""
        if jax.process_count() == 1:
            return packed
        return jax.make_array_from_process_local_data(self._replicated, packed)
