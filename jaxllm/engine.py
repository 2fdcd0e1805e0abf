"""The engine: the scheduler and the block pool on the host, the model runner on the device.

One `step()` = `Scheduler.schedule()` -> `BatchBuilder.build()` -> `ModelRunner.execute()` ->
`Scheduler.update()`, then stop strings (which need the tokenizer) are checked here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.model.checkpoint import RANDOM_PREFIX, load_params
from jaxllm.model.kv_cache import kv_cache_bytes_per_block
from jaxllm.model.sharding import make_mesh
from jaxllm.outputs import RequestMetrics, RequestOutput
from jaxllm.platform import CPU_KV_CACHE_BYTES, Platform
from jaxllm.runner import COMPILATIONS, ModelRunner, step_scratch_bytes
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import (
    PLACEHOLDER,
    BatchBuilder,
    BucketLadder,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    Sequence,
)
from jaxllm.sched.batch import BucketShape
from jaxllm.startup import configure_compilation_cache, eos_token_ids, resolve_model, timed_phase
from jaxllm.tokenizer import IncrementalDetokenizer, decode_tokens, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """The engine's record of one request beside the scheduler's `Sequence`."""

    seq: Sequence
    prompt: str | None
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None = None  # only for requests with stop strings
    stop_text_end: int | None = None  # where a stop string cut the text


@dataclass
class _InFlight:
    """A dispatched step whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    tokens: jax.Array  # [max_sampled_rows] on the device
    finished: list[Sequence]  # finished by `commit` (max_tokens), awaiting their last token


@dataclass
class StepStats:
    """Tokens and seconds of one kind of step, accumulated.

    `seconds` is the wall time of `Engine.step`; of it, `dispatch_seconds` went into handing the
    step to the device (`ModelRunner.execute`) and `wait_seconds` into reading the previous
    step's tokens (waiting for the device, booked under this step's kind, so the first decode
    step after a prefill waits for that prefill); the rest is host work.
    """

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    dispatch_seconds: float = 0.0
    wait_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class EngineStats:
    prefill: StepStats = field(default_factory=StepStats)
    decode: StepStats = field(default_factory=StepStats)


class Engine:
    """Runs requests to completion, one step at a time.

    Mutates: the scheduler's queues and block pool, the runner's KV cache, its request records.
    """

    def __init__(self, model: str, config: EngineConfig, platform: Platform) -> None:
        configure_compilation_cache()
        self.config = config
        self.platform = platform
        # Seconds of each start-up phase, logged at INFO and kept for bench.py's record.
        self.startup_seconds: dict[str, float] = {}
        phase = functools.partial(timed_phase, self.startup_seconds)
        model_path = resolve_model(model)
        # NOTE: the "tp" mesh; load_params checks that it divides the heads before any read.
        self.mesh = make_mesh(config.tensor_parallel_size)
        with phase("load weights"):
            model_config, params = load_params(
                model_path, dtype=config.dtype or platform.dtype, seed=config.seed, mesh=self.mesh
            )
        self.model_config = model_config
        kv_heads = model_config.num_kv_heads // config.tensor_parallel_size
        self.kernels = platform.kernels(config.kvcache_block_size, kv_heads)
        is_random = model_path.startswith(RANDOM_PREFIX)
        with phase("load the tokenizer"):
            self.tokenizer = load_tokenizer(None if is_random else model_path)
        # NOTE: Qwen3's generation config stops on <|im_end|> and <|endoftext|>; so does the
        # embedded default.
        eos = (
            (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
            if is_random
            else eos_token_ids(self.tokenizer, model_path)
        )

        block_size = config.kvcache_block_size
        tile = platform.prefill_tile
        budget = max(tile, config.max_num_batched_tokens // tile * tile)
        # NOTE: the cache's size is settled below; nothing else of the scheduler depends on it.
        sizing = SchedulerConfig(
            num_blocks=1,
            block_size=block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=config.max_model_len,
            prefill_tile=tile,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_ids=tuple(int(t) for t in eos if t is not None),
        )
        # NOTE: FA3 (and the Pallas decode kernel, whose prefill is FA3's) reads only each
        # sequence's context, so the table width does not change its work: every table is
        # padded to the widest (fewer executables). The portable backend gathers whole tables.
        one_width = self.kernels.prefill == "flash"
        ladder = BucketLadder.from_config(sizing, one_width=one_width)
        with phase("size the KV cache"):
            num_blocks = config.num_kvcache_blocks or self._fit_num_blocks(
                params, block_size, ladder
            )
        if num_blocks * block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
                f"({num_blocks * block_size} tokens), less than one request of max_model_len="
                f"{config.max_model_len}; raise num_kvcache_blocks (or memory_fraction), or lower "
                "max_model_len"
            )
        self.scheduler_config = dataclasses.replace(sizing, num_blocks=num_blocks)
        self.scheduler = Scheduler(self.scheduler_config, eviction_policy=config.eviction_policy)
        self.batch_builder = BatchBuilder(self.scheduler_config, one_width=one_width)
        with phase("allocate the KV cache"):
            self.runner = ModelRunner(
                self.model_config,
                params,
                num_blocks=num_blocks,
                block_size=block_size,
                max_sampled_rows=max(shape.num_sampled for shape in ladder.all_shapes()),
                kernels=self.kernels,
                mesh=self.mesh,
            )
        if config.compile_at_startup:
            with phase("compile"):
                self.runner.compile(self.batch_builder.ladder.all_shapes())
            with phase("warm up"):
                self.runner.warm_up()
        self.compilations_at_startup = COMPILATIONS.count
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}
        self._in_flight: _InFlight | None = None
        self._last_wait_seconds = 0.0  # of the last `_apply_in_flight`
        self._compiled_lazily: set[tuple[BucketShape, str]] = set()  # (bucket, sampler mode)

    def _fit_num_blocks(self, params, block_size: int, ladder: BucketLadder) -> int:
        """KV blocks that fit in `memory_fraction` of the device beside the params and the
        scratch memory of the largest step (measured by compiling it over a one-block cache)."""
        config = self.config
        per_block = kv_cache_bytes_per_block(
            self.model_config, block_size, tensor_parallel_size=config.tensor_parallel_size
        )
        blocks_per_seq = -(-config.max_model_len // block_size)
        if not self.platform.gpu:
            wanted = config.max_num_seqs * blocks_per_seq
            return max(blocks_per_seq, min(wanted, CPU_KV_CACHE_BYTES // per_block))
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit", 0) * config.memory_fraction
        largest = max(ladder.all_shapes(), key=lambda shape: (shape.num_tokens, shape.width))
        scratch = step_scratch_bytes(
            self.model_config, params, largest, block_size, self.mesh, self.kernels
        )
        if scratch is None:  # no account from XLA: a generous estimate (logits, MLP, attention)
            c = self.model_config
            scratch = largest.num_tokens * (c.hidden_size * 8 + c.intermediate_size * 6) * 4
            scratch += config.max_num_seqs * c.vocab_size * 4 * 4
        # NOTE: the params are already on the device, counted in bytes_in_use; the sampler's
        # scratch is small beside the largest step's and comes out of the 10% margin.
        free = limit - scratch - stats.get("bytes_in_use", 0)
        return max(1, int(free // per_block))

    # Requests.

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError if the request can never run; changes nothing."""
        vocab = self.model_config.vocab_size
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty")
        ids = np.asarray(prompt_token_ids)
        if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1:
            raise ValueError("token ids must be a flat list of integers")
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise ValueError(
                f"token id {int(bad[0])} is outside the model's vocabulary [0, {vocab})"
            )
        self.scheduler.validate(ids, params)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> int:
        """Queues a request (validated first); returns its id."""
        self.validate(prompt_token_ids, params)
        seq = self.scheduler.add(prompt_token_ids, params)
        request = _Request(seq, prompt, RequestMetrics(arrival_time=time.perf_counter()))
        if params.stop:
            # NOTE: no prompt context: a prompt ending inside a multi-byte character would
            # otherwise change the output's first characters, and the text must equal the
            # output tokens decoded alone (what `_output` returns without a stop string).
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._requests[seq.seq_id] = request
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        """Finishes a live request without output (mutates the scheduler); others: no-op."""
        self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)

    def sequence(self, request_id: int) -> Sequence:
        """The scheduler's live `Sequence` of a request (read it, never mutate it)."""
        return self._requests[request_id].seq

    def has_request(self, request_id: int) -> bool:
        """Whether the request is queued, running or finished with its output not yet returned."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # The step.

    def step(self) -> list[RequestOutput]:
        """Dispatches the next step, then reads the previous one's tokens; returns the outputs
        of the requests that finished.

        The host is one step ahead of the device: it schedules and dispatches step N while step
        N-1 still runs, then reads N-1's tokens (`Scheduler.apply`) and records what N computed
        (`Scheduler.commit`). Step N reads the tokens it needs from N-1's result on the device.
        So outputs arrive one call after their last step; a call with nothing left to schedule
        just reads the last step.
        """
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        tokens = None
        if scheduled is not None:
            descriptor = self.batch_builder.build(scheduled)
            if not self.config.compile_at_startup:
                self._compile_lazily(descriptor)
            previous = self._in_flight
            source_rows = self._source_rows(descriptor, previous)
            dispatch_start = time.perf_counter()
            tokens = self.runner.execute(
                descriptor, previous.tokens if previous is not None else None, source_rows
            )
            dispatch_seconds = time.perf_counter() - dispatch_start
        finished = self._apply_in_flight()
        if scheduled is not None:
            self._in_flight = _InFlight(scheduled, tokens, self.scheduler.commit(scheduled))
            kind = self.stats.prefill if scheduled.is_prefill else self.stats.decode
            kind.tokens += scheduled.num_tokens
            kind.seconds += time.perf_counter() - start
            kind.steps += 1
            kind.dispatch_seconds += dispatch_seconds
            kind.wait_seconds += self._last_wait_seconds
        return finished

    def _compile_lazily(self, descriptor) -> None:
        """Compiles the executables of a step the first time its bucket and sampler show up.

        NOTE: compiled here, as expected, so the runner warns only about a step that a ladder
        compiled at start-up missed.
        """
        key = (descriptor.shape, self.runner.sampler_mode(descriptor))
        if key not in self._compiled_lazily:
            self.runner.compile([descriptor.shape], use_tqdm=False, sampler_modes=key[1:])
            self._compiled_lazily.add(key)

    @staticmethod
    def _source_rows(descriptor, previous: _InFlight | None) -> np.ndarray | None:
        """[T] the previous step's row each placeholder input reads (-1: none), or None."""
        rows = np.flatnonzero(descriptor.token_ids == PLACEHOLDER)
        if len(rows) == 0:
            return None
        row_of = {seq.seq_id: row for row, seq in enumerate(previous.batch.seqs)}
        sources = np.full(descriptor.token_ids.shape, -1, np.int32)
        sources[rows] = [row_of[descriptor.seqs[row].seq_id] for row in rows]
        return sources

    def _apply_in_flight(self) -> list[RequestOutput]:
        """Reads the in-flight step's tokens (waits for them), applies them and stop strings;
        returns the outputs of the requests that finished."""
        in_flight, self._in_flight = self._in_flight, None
        self._last_wait_seconds = 0.0
        if in_flight is None:
            return []
        batch = in_flight.batch
        wait_start = time.perf_counter()
        tokens = np.asarray(in_flight.tokens)
        self._last_wait_seconds = time.perf_counter() - wait_start
        finished = in_flight.finished + [
            seq for seq in self.scheduler.apply(batch, tokens) if seq not in in_flight.finished
        ]
        now = time.perf_counter()
        finished_ids = {seq.seq_id for seq in finished}
        for seq, appended in zip(batch.seqs, batch.appends, strict=True):
            request = self._requests.get(seq.seq_id)
            if request is None or not appended:
                continue
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            if request.detokenizer is not None and self._hit_stop_string(request):
                self.scheduler.finish(seq, "stop")
                seq.finish_reason = "stop"
                if seq.seq_id not in finished_ids:
                    finished.append(seq)
                    finished_ids.add(seq.seq_id)
        return [self._output(seq, now) for seq in finished if seq.seq_id in self._requests]

    def _hit_stop_string(self, request: _Request) -> bool:
        """Feeds the newest token to the request's detokenizer; True once a stop string shows."""
        seq = request.seq
        params = seq.params
        detokenizer = request.detokenizer
        delta = detokenizer.step(seq.output_token_ids[-1])
        if not delta or seq.num_output_tokens < params.min_tokens:
            return False
        longest = max(len(stop) for stop in params.stop)
        search_from = max(0, len(detokenizer.text) - len(delta) - longest + 1)
        positions = [detokenizer.text.find(stop, search_from) for stop in params.stop]
        hits = [position for position in positions if position >= 0]
        if not hits:
            return False
        request.stop_text_end = min(hits)
        return True

    def _output(self, seq: Sequence, now: float) -> RequestOutput:
        request = self._requests.pop(seq.seq_id)
        request.metrics.finished_time = now
        if request.stop_text_end is not None:
            text = request.detokenizer.text[: request.stop_text_end]
        else:
            text = decode_tokens(
                self.tokenizer, seq.output_token_ids, seq.params.skip_special_tokens
            )
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=request.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens or 0,
            metrics=request.metrics,
        )
