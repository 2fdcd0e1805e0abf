"""The public API: `LLM`, with vLLM's names (the one-call `jaxllm.generate`: `jaxllm.notebook`)."""

from __future__ import annotations

import collections
import gc
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jaxllm.cache import CacheStats
from jaxllm.config import EngineConfig
from jaxllm.fields import check_flag
from jaxllm.generation_config import generation_fields
from jaxllm.interrupts import interrupts_held
from jaxllm.model.attention import Kernels
from jaxllm.model.config import Qwen3Config
from jaxllm.outputs import RequestOutput, StreamDelta
from jaxllm.platform import Platform
from jaxllm.prompts import Prompt, chat_prompts, one_per_prompt, parse_prompts, with_derived_seeds
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.startup import check_model, engine_settings, start_engine
from jaxllm.streams import RequestStream

Message = dict[str, Any]


class LLM:
    """A Qwen3 model served by jaxllm's engine.

    Args:
        model: a Hugging Face Qwen3 directory, an orbax checkpoint saved by `LLM.save`, a Hub
            id, or "random:<shape>" ("random:qwen3-tiny", ...); None: the embedded default
            (`Platform.default_model`), with `Platform.default_engine_kwargs` under the given ones.
        **kwargs: `EngineConfig` fields (memory_fraction: another name of gpu_memory_utilization).

    Raises:
        TypeError: an unknown argument.
        ValueError: an invalid setting, or a KV cache too small for one max_model_len request.
        FileNotFoundError: a model path that does not exist.

    Mutates: `generate`, `chat` and `stream` run the engine (its KV cache and prefix cache).
    One thread at a time runs it: calls from several threads wait their turn. Ctrl-C (a
    `KeyboardInterrupt`) is held back until the step running ends, then aborts the requests of
    the call it interrupts; the LLM serves the next call as before.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any) -> None:
        kwargs = EngineConfig.check_kwargs(kwargs)
        check_model(model)
        platform = Platform.detect()
        # NOTE: a GPU's KV cache is sized from free memory, so engines dropped before free
        # theirs first; a CPU's has a fixed size, and a full collection there can take a second.
        if platform.gpu:
            gc.collect()
        self.model, config = engine_settings(model, kwargs, platform)
        self.engine = start_engine(self.model, config, platform)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.last_run_stats: dict[str, float] = {}
        self._seeds_drawn = 0  # derived seeds of the requests validated so far
        self._lock = threading.Lock()
        # NOTE: outputs of requests finished by a step that another call ran (an interleaved
        # `stream`), kept until their caller asks.
        self._finished: dict[int, RequestOutput] = {}
        # Requests of streams closed while the engine was busy, aborted at its next safe point
        # (`_abort_closed`): the collector closes a dropped stream in any thread, at any time.
        self._closed: collections.deque[int] = collections.deque()

    @property
    def model_config(self) -> Qwen3Config:
        return self.engine.runner.config

    @property
    def num_kvcache_blocks(self) -> int:
        return self.engine.scheduler.config.num_blocks

    @property
    def num_executables(self) -> int:
        return self.engine.runner.num_executables

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (or loading) the ladder's executables at start-up."""
        return self.engine.startup_seconds.get("compile", 0.0)

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Seconds of each start-up phase (`jaxllm.startup.start_engine`)."""
        return dict(self.engine.startup_seconds)

    @property
    def kernels(self) -> Kernels:
        """The attention kernels of prefill and decode steps (`jaxllm.platform` chose them)."""
        return self.engine.runner.kernels

    @property
    def num_compilations_since_startup(self) -> int:
        """XLA executables built in this process since this engine finished starting."""
        return self.engine.runner.num_executables - self.engine.compiled_at_startup

    def get_default_sampling_params(self) -> SamplingParams:
        """What calls without sampling params sample with: the model's generation_config.json
        over SamplingParams() (vLLM's rule, `generation_config.default_sampling_params`).
        Frozen: change it with `dataclasses.replace(llm.get_default_sampling_params(), ...)`."""
        return self.engine.default_sampling_params

    @property
    def params(self) -> Any:
        """The weights run (jax arrays; q/k/v, gate/up fused); None after sleep(level=2)."""
        return self.engine.runner.params

    def update_params(self, params: Any, donate: bool = False) -> None:
        """Runs with new weights (a trainer's, say), compiling nothing: a tree like `params` (or
        Hugging Face names, cast to the model's dtype). Arrays placed as the current ones are used
        as they are (a computation donating them deletes them), others copied to their devices
        (`donate`: buffers given up to the copies). Empties the prefix cache.

        Raises:
            ValueError: another tree structure, shape or dtype, or a deleted array, naming it.
            TypeError: donate not a bool.
            RuntimeError: requests are running (a stream not yet exhausted).
        """
        check_flag("donate", donate)
        with self._lock:
            self._abort_closed()
            self.engine.update_params(params, donate)

    def sleep(self, level: int = 1) -> None:
        """Frees the KV cache (level 1), and the weights (2); `wake_up` compiles nothing."""
        with self._lock:
            self._abort_closed()
            self.engine.sleep(level)

    def wake_up(self) -> None:
        with self._lock:
            self.engine.wake_up()

    def cache_stats(self) -> CacheStats:
        """Prefix-cache statistics: queried and hit tokens, hit rate, evictions, blocks."""
        return self.engine.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (its statistics kept), as vLLM's: True, or False while
        requests run (a stream not yet exhausted), leaving it as it was."""
        with self._lock:
            self._abort_closed()
            return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        """The tokenizer (vLLM's name for `tokenizer`)."""
        return self.tokenizer

    def save(self, path: str | Path, overwrite: bool = False) -> None:
        """Saves the model as a directory that `LLM(path)` loads back, verifying it: the params
        (orbax) with their config and checksums, the tokenizer, and a generation_config.json of
        the eos ids it stops at and its default sampling settings.

        All of it is written beside `path` and moved in at the end, so an error or Ctrl-C
        leaves `path` as it was. `overwrite=True` lets it write into a non-empty directory,
        replacing only files of the same names.

        Raises:
            ValueError: `path` is a non-empty directory (without `overwrite`) or not a directory.
            TypeError: overwrite not a bool.
            RuntimeError: the weights were dropped by sleep(level=2).
        """
        from jaxllm.model.checkpoint import save_model

        check_flag("overwrite", overwrite)
        generation = generation_fields(self.engine.default_sampling_params)
        generation["eos_token_id"] = list(self.engine.scheduler.config.eos_token_ids)
        with self._lock:
            if self.params is None:
                raise RuntimeError("no weights to save: sleep(level=2) dropped them")
            save_model(path, self.model_config, self.params, self.tokenizer, generation, overwrite)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates a completion for each prompt; returns them in prompt order.

        Args:
            prompts: one prompt or a list (any ordered iterable) of them; a prompt is a
                string, token ids (a list or 1-d integer array), or vLLM's {"prompt": text} or
                {"prompt_token_ids": ids} (its "prompt" too: the output's; `jaxllm.prompts`).
            sampling_params: one SamplingParams for all (default: the model's,
                `get_default_sampling_params()`), or one per prompt.
            use_tqdm: show a progress bar with prefill and decode tokens/s.

        Raises:
            ValueError: an empty, too long or out-of-vocabulary prompt, a request that can never
                fit in the KV cache, or a sampling_params list of the wrong length (nothing runs).
            TypeError: use_tqdm not a bool.
        """
        check_flag("use_tqdm", use_tqdm)
        with self._lock:
            return self._run(self._requests(prompts, sampling_params), use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them (`jaxllm.prompts.chat_prompts`:
        vLLM's arguments, and Qwen3's `enable_thinking`).

        Raises:
            ValueError, TypeError: what `chat_prompts` or `generate` refuses (nothing runs).
        """
        prompts = chat_prompts(
            self.tokenizer,
            messages,
            enable_thinking=enable_thinking,
            chat_template_kwargs=chat_template_kwargs,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[StreamDelta]:
        """Returns an iterator of `StreamDelta`s (text, token_ids, index) of one prompt's
        completions.

        The text deltas of completion `index` concatenate to its final text and the token
        deltas to its token ids (with n = 1, the `RequestOutput`'s `text` and `token_ids`); its
        last delta carries its `finish_reason` and `stop_reason`, the others None. Its logprobs
        deltas (with `logprobs`) concatenate to its `logprobs`; completion 0's first delta
        carries the `prompt_logprobs`. With stop strings, the last (longest stop string - 1)
        characters are held back until they cannot start a stop string (unless
        `include_stop_str_in_output`). The request is queued at the first `next()`; closing the
        iterator early aborts it.

        Raises:
            ValueError: as `generate` does, at once (before anything runs).
        """
        with self._lock:
            (request,) = self._requests(prompt, sampling_params, caller="stream")
        return self._stream(request)

    def _stream(self, request: Request):
        request_id = request.request_id
        stream = RequestStream(request, self.tokenizer, self.engine.token_texts)
        try:
            with self._lock, interrupts_held():
                self.engine.check_awake()  # NOTE: again: it may have slept since `stream`
                self.engine.add(request)
            while True:
                with self._lock:  # NOTE: released at each yield, so other callers go on
                    if request_id not in self._finished:
                        self._step()
                    output = self._finished.pop(request_id, None)
                    live = self.engine.has_request(request_id)
                    deltas = stream.new() if output is None else stream.last(output)
                if output is None and not live:
                    raise RuntimeError(f"request {request_id} was aborted")
                yield from deltas
                if output is not None:
                    return
        finally:
            # NOTE: never waits: the collector closes dropped streams in any thread, mid-step too
            self._closed.append(request_id)
            if self._lock.acquire(blocking=False):
                try:
                    self._abort_closed()
                finally:
                    self._lock.release()

    def _abort_closed(self) -> None:
        """Aborts the requests of closed streams (a no-op for those that finished) and drops
        their outputs. Called holding the lock, between steps."""
        while self._closed:
            with interrupts_held():
                request_id = self._closed.popleft()
                self._finished.pop(request_id, None)
                self.engine.abort(request_id)

    def _step(self) -> list[int]:
        """Runs one engine step, Ctrl-C held back until it ends; files its finished outputs
        under `_finished`, returns their ids. Aborts the requests of closed streams first."""
        self._abort_closed()
        with interrupts_held():
            finished = {output.request_id: output for output in self.engine.step()}
            self._finished.update(finished)
        return list(finished)

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        caller: str | None = None,
    ) -> list[Request]:
        """The engine's requests of a call, all validated before any is queued (prompt forms:
        `jaxllm.prompts`); a `caller` ("stream") takes one prompt."""
        self.engine.check_awake()
        parsed = parse_prompts(prompts)
        if caller is not None and len(parsed) != 1:
            raise ValueError(f"{caller}() takes one prompt, got {len(parsed)}")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = one_per_prompt(sampling_params, len(parsed))
        params, seeds_drawn = with_derived_seeds(params, self.config.seed, self._seeds_drawn)
        requests = []
        for index, ((text, tokens), param) in enumerate(zip(parsed, params, strict=True)):
            if tokens is None:
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                if not tokens:
                    raise ValueError(f"prompt {index}: the prompt is empty text, of no tokens")
            try:
                requests.append(self.engine.new_request(tokens, param, prompt=text))
            except ValueError as error:
                raise ValueError(f"prompt {index}: {error}") from None
        self._seeds_drawn = seeds_drawn  # NOTE: a refused call draws none
        return requests

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        before = engine.stats.snapshot()
        ids = [request.request_id for request in requests]
        pending = set(ids)
        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        # NOTE: what lives now (the engine, jax, the caller's objects) is frozen for the call
        # only (the collector's passes as outputs pile up skip it; a dropped engine is freed),
        # unless the caller froze objects: unfreezing ours would unfreeze theirs.
        freeze = False
        try:
            if freeze := gc.get_freeze_count() == 0:
                gc.freeze()
            with interrupts_held():  # NOTE: a request half added could not be aborted
                for request in requests:
                    engine.add(request)
            while len(outputs) < len(ids):
                step_before = engine.stats.snapshot()
                for request_id in self._step():
                    if request_id in pending:
                        outputs[request_id] = self._finished.pop(request_id)
                        bar.update(1)
                step = engine.stats.since(step_before) if use_tqdm else {}
                if step.get("prefill_steps") or step.get("decode_steps"):  # NOTE: it ran a plan
                    kind = "Prefill" if step["prefill_steps"] else "Decode"
                    rate = step["prefill_tok_s"] or step["decode_tok_s"]
                    bar.set_postfix_str(f"{kind}: {rate:,.0f}tok/s", False)
                if len(outputs) < len(ids) and not engine.has_unfinished():
                    raise RuntimeError("the engine stopped with requests unfinished")
        except BaseException:
            with interrupts_held():  # NOTE: a second Ctrl-C would leave requests running
                for request_id in ids:  # a no-op for those already finished
                    engine.abort(request_id)
                    self._finished.pop(request_id, None)
            raise
        finally:
            with interrupts_held():
                bar.close()
                if freeze:
                    gc.unfreeze()
        self.last_run_stats = engine.stats.since(before)
        return [outputs[request_id] for request_id in ids]
