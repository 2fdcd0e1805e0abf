"""The engine: requests in, one step at a time, outputs out.

A step reads top to bottom: `Scheduler.schedule` plans it, `ModelRunner.execute` runs the plan,
`Scheduler.update` applies the sampled tokens. The host runs one step ahead of the device: it
dispatches step N before it applies step N - 1's tokens, which the device has meanwhile sampled.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time

import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.detokenizer import StopStrings
from jaxllm.handoff import StepwiseMasks
from jaxllm.outputs import EngineStats, RequestMetrics, RequestOutput
from jaxllm.request import Request, TokenTexts, completion_params
from jaxllm.runner import ModelRunner
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, StepPlan
from jaxllm.sched.processors import SequenceProcessors, bad_word_ids, one_token_words
from jaxllm.steps import StepResult
from jaxllm.structured import Grammars, grammar_rows
from jaxllm.weights import deleted_leaf


class Engine:
    """Runs requests to completion, one step at a time (`jaxllm.startup.start_engine` builds it):
    the scheduler is the host side (queues, block pool, plans), the runner the device side.

    Mutates: the scheduler's queues and block pool, the runner's KV cache, its request records.
    """

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer,
        startup_seconds: dict,
        default_sampling_params: SamplingParams,
    ) -> None:
        self.config = config
        self.default_sampling_params = default_sampling_params
        self.scheduler = scheduler
        self.runner = runner
        self.compiled_at_startup = runner.num_executables
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.startup_seconds = startup_seconds
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}  # by request id: its first sequence's id
        self._by_seq: dict[int, Request] = {}
        self._in_flight: tuple[StepPlan, StepResult] | None = None
        # The next step's plan, made while a constrained step's forward pass ran (`_masks`).
        self._next_plan: StepPlan | None = None
        eos = scheduler.config.eos_token_ids
        self.grammars = Grammars(tokenizer, runner.config.vocab_size, eos)

    def new_request(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> Request:
        """A request, validated but not queued (`add` queues it); changes nothing else.

        Raises:
            ValueError: truncate_prompt_tokens above max_model_len, a token id outside the
                vocabulary (of the prompt as truncated), logprobs above max_logprobs or the
                vocabulary, an invalid structured output, or a request the scheduler refuses
                (`Scheduler.new_sequence`).
            ImportError: structured outputs without llguidance installed.
        """
        prompt_token_ids = self._truncated(prompt_token_ids, params.truncate_prompt_tokens)
        vocab = self.runner.config.vocab_size
        bad = next((token for token in prompt_token_ids if not 0 <= token < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
        bad_words, processes = self._check_params(params)
        grammar = params.structured_outputs and self.grammars.compile(params.structured_outputs)
        seqs = []
        for index in range(params.n):
            child = params if params.n == 1 else completion_params(params, index)
            stop_strings = StopStrings(self.tokenizer, child) if child.stop else None
            processors = SequenceProcessors(vocab, bad_words) if processes else None
            sequence_grammar = grammar and self.grammars.sequence_grammar(grammar)
            seq = self.scheduler.new_sequence(
                prompt_token_ids, child, stop_strings, processors, sequence_grammar
            )
            seq.parent = seqs[0] if index else None
            seqs.append(seq)
        return Request(seqs, prompt, RequestMetrics(arrival_time=0.0))

    def _truncated(self, prompt_token_ids, keep: int | None):
        """The prompt's last `keep` tokens (`SamplingParams.truncate_prompt_tokens`)."""
        if keep is None:
            return prompt_token_ids
        limit = self.scheduler.config.max_model_len
        if keep > limit:
            raise ValueError(
                f"SamplingParams.truncate_prompt_tokens={keep} is more than max_model_len={limit}"
            )
        return prompt_token_ids[-(limit - 1 if keep == -1 else keep) :]

    def _check_params(self, params: SamplingParams) -> tuple[tuple[tuple[int, ...], ...], bool]:
        """The token ids of the bad words, and whether logits processors apply (min_tokens: when
        it has stop tokens to ban), after checking the params against the model and the engine.

        Raises:
            ValueError: logprobs above max_logprobs or the vocabulary, a `logit_bias` key or an
                `allowed_token_ids` or `stop_token_ids` entry outside the vocabulary, or allowed
                tokens that one-token bad words, with min_tokens' ban of the stop tokens, ban
                all of, naming the field.
        """
        vocab, most = self.runner.config.vocab_size, self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name) or 0
            if value > most:
                raise ValueError(
                    f"SamplingParams.{name}={value} is more than max_logprobs={most} (an LLM "
                    "setting)"
                )
            if value > vocab:
                raise ValueError(
                    f"SamplingParams.{name}={value} is more than the model's vocabulary ({vocab})"
                )
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            outside = [token for token in getattr(params, name) or () if token >= vocab]
            if outside:
                raise ValueError(
                    f"SamplingParams.{name} names token {outside[0]}, outside the model's "
                    f"vocabulary [0, {vocab})"
                )
        stops = self.scheduler.config.stop_tokens(params.stop_token_ids, params.ignore_eos)
        words = bad_word_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        # NOTE: a word with a token past the model's vocabulary can never be generated.
        words = tuple(word for word in words if max(word) < vocab)
        if params.allowed_token_ids:
            allowed, banned = {*params.allowed_token_ids}, one_token_words(words)
            if banned >= allowed:
                raise ValueError(
                    "SamplingParams.allowed_token_ids holds only tokens that bad_words bans: "
                    "nothing is left to sample"
                )
            if params.min_tokens and banned | stops >= allowed:
                raise ValueError(
                    "SamplingParams.allowed_token_ids holds only stop tokens (eos, "
                    "stop_token_ids) and tokens that bad_words bans; min_tokens bans the stop "
                    "tokens: nothing is left to sample"
                )
        bans = params.min_tokens and any(token < vocab for token in stops)
        return words, params.processes_logits or bans

    def add(self, request: Request) -> None:
        """Queues a request made by `new_request`."""
        request.metrics.arrival_time = time.perf_counter()
        self._requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
            self._by_seq[seq.seq_id] = request

    def abort(self, request_id: int) -> None:
        """Finishes a live request without output (mutates the scheduler); others: no-op."""
        request = self._requests.pop(request_id, None)
        for seq in request.seqs if request is not None else ():
            self.scheduler.abort(seq.seq_id)
            self._by_seq.pop(seq.seq_id, None)

    def reset(self) -> None:
        """Drops every request, the step in flight, the prefix cache and the KV cache (allocated
        anew). What a step left half done cannot be trusted, so the engine goes back to the
        state of a fresh one, which serves new requests alike."""
        self._in_flight = self._next_plan = None
        self._requests.clear()
        self._by_seq.clear()
        try:
            self.scheduler.reset()  # its pool empties even where an eviction policy raises
        finally:
            self.runner.reset()

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache: True, or False while a sequence is live (nothing changed)."""
        if self.scheduler.has_unfinished():
            return False
        self._require_idle("reset_prefix_cache")  # drops a step left in flight
        self.scheduler.reset()
        return True

    def update_params(self, params, donate: bool = False) -> None:
        """New weights (`ModelRunner.update_params`); the prefix cache, which holds the old
        weights' KV, is emptied."""
        self._require_idle("update_params")
        self.runner.update_params(params, donate)
        self.scheduler.reset()

    def sleep(self, level: int = 1) -> None:
        """Frees the KV cache (level 1), and drops the weights (level 2)."""
        if not isinstance(level, int) or isinstance(level, bool) or level not in (1, 2):
            raise ValueError(
                f"sleep level must be 1 (the KV cache) or 2 (and weights), got {level!r}"
            )
        self._require_idle("sleep")
        self.scheduler.reset()
        self.runner.sleep(weights=level == 2)

    def wake_up(self) -> None:
        self.runner.wake_up()

    def check_awake(self) -> None:
        """Raises RuntimeError unless the engine can run steps (awake, with weights)."""
        if self.runner.kv_cache is None:
            raise RuntimeError("the LLM is asleep (LLM.sleep): call LLM.wake_up() first")
        if self.runner.params is None:
            raise RuntimeError(
                "the LLM's weights were dropped by sleep(level=2): call LLM.update_params first"
            )
        deleted = deleted_leaf(self.runner.params)
        if deleted is not None:
            raise RuntimeError(
                f"the LLM's weight params{deleted} was deleted (given to update_params, then "
                "donated to another computation?): call LLM.update_params with live arrays"
            )

    def _require_idle(self, what: str) -> None:
        """Raises RuntimeError while a sequence is live; else drops what is left in flight (a
        step planned before the last sequence stopped: its tokens change nothing, but its
        mailbox's thread is let finish with it) and a plan made ahead and never run, with the
        prefix cache, which holds its blocks unwritten."""
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"{what} while requests are running: finish or abort them first")
        if self._next_plan is not None:
            self.scheduler.reset()
        if self._in_flight is not None and self._in_flight[1].kept is not None:
            concurrent.futures.wait([self._in_flight[1].kept])
        self._in_flight = self._next_plan = None

    def has_request(self, request_id: int) -> bool:
        """Whether the request is queued, running or finished with its output not yet returned."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self._in_flight is not None
            or self._next_plan is not None
        )

    def step(self) -> list[RequestOutput]:
        """Plans and dispatches the next step, then applies the previous step's tokens; returns
        the outputs of the requests that finished.

        Outputs arrive one call after their last step. While the plan needs every sampled token
        on the host (bad words of several tokens: `Scheduler.needs_host_tokens`), the previous
        step's tokens are applied first. A plan with grammars gets its masks from `_masks` (of
        several steps, from `StepwiseMasks` through the runner's mailbox). A step that raises
        (a device error, an interrupt it did not hold back) resets the engine first (`reset`).
        """
        start = time.perf_counter()
        outputs: list[RequestOutput] = []
        seconds = {"wait": 0.0, "masks": 0.0, "masks_late": 0}
        try:
            plan, self._next_plan = self._next_plan, None
            if self.scheduler.needs_host_tokens:
                outputs += self._apply_in_flight(seconds)
            if plan is None:
                plan = self.scheduler.schedule()
            dispatch_start, waited = time.perf_counter(), seconds["wait"]
            result = masks = stepwise = None
            if plan is not None:
                if self.scheduler.num_constrained and any(grammar_rows(plan)):
                    masks = functools.partial(self._masks, plan, seconds, outputs)
                    if plan.bucket.num_steps > 1:
                        stepwise = StepwiseMasks(plan, self.grammars.vocab_size)
                        if self.runner.mailbox.overlaps:  # the first step's too, on its thread
                            masks = None
                result = self.runner.execute(plan, masks, stepwise)
            elif self._in_flight is None and self.scheduler.has_unfinished():
                self.grammars.wait([seq.grammar for seq in self.scheduler.waiting])
            dispatch_seconds = time.perf_counter() - dispatch_start - (seconds["wait"] - waited)
            outputs += self._apply_in_flight(seconds)
            if stepwise is not None:
                stepwise.ready.set()
        except BaseException as error:
            try:
                self.reset()
            except Exception as reset_error:  # an eviction policy's: the step's error is raised
                error.add_note(f"resetting the engine raised too: {reset_error!r}")
            raise
        if plan is not None:
            self._in_flight = (plan, result)
            kind = self.stats.prefill if plan.is_prefill else self.stats.decode
            kind.tokens += plan.num_tokens
            kind.seconds += time.perf_counter() - start
            kind.steps += 1
            kind.forward_passes += plan.bucket.num_steps
            kind.dispatch_seconds += dispatch_seconds
            kind.wait_seconds += seconds["wait"]
            kind.masks_seconds += seconds["masks"]
            kind.masks_late_steps += seconds["masks_late"]
        return outputs

    def _apply_in_flight(self, seconds: dict[str, float]) -> list[RequestOutput]:
        """Applies the step in flight, if any, adding its wait for the tokens to `seconds`;
        returns the outputs of the requests that finished."""
        if self._in_flight is None:
            return []
        (plan, result), self._in_flight = self._in_flight, None
        wait_start = time.perf_counter()
        sampled = np.asarray(result.tokens)
        logprobs = None if result.logprobs is None else np.asarray(result.logprobs)
        now = time.perf_counter()
        seconds["wait"] += now - wait_start
        # NOTE: a plan of several steps advanced its grammars step by step while it ran
        accepted = None if result.kept is None else result.kept.result()
        finished = self.scheduler.update(plan, sampled, logprobs, accepted)
        for seq, samples in zip(plan.seqs, plan.samples, strict=True):
            request = self._by_seq.get(seq.seq_id)
            if samples and request is not None and request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
        done = {self._by_seq[seq.seq_id] for seq in finished if seq.seq_id in self._by_seq}
        return [
            self._output(request, now)
            for request in sorted(done, key=lambda request: request.request_id)
            if all(seq.is_finished for seq in request.seqs)
        ]

    def _masks(self, plan: StepPlan, seconds: dict, outputs: list, forward) -> np.ndarray:
        """`plan`'s token bitmask, filled after the step in flight is applied (its tokens advance
        the grammars; its finished requests join `outputs`). The first step's of a plan of
        several (`forward` None) before it is dispatched; for one step, while its forward pass
        (`forward`: the future of its logits and settings) is dispatched and runs, the next step
        planned then too so that its forward pass follows this step's sampler at once (late: the
        forward pass was done)."""
        outputs += self._apply_in_flight(seconds)
        start = time.perf_counter()
        bitmask = self.grammars.bitmask(plan)
        seconds["masks"] += time.perf_counter() - start
        if forward is not None:
            if not self.scheduler.needs_host_tokens:
                self._next_plan = self.scheduler.schedule()
            seconds["masks_late"] += forward.done() and forward.result()[0].is_ready()
        return bitmask

    def _output(self, request: Request, now: float) -> RequestOutput:
        """The output of a request whose completions all finished; forgets the request."""
        del self._requests[request.request_id]
        for seq in request.seqs:
            del self._by_seq[seq.seq_id]
        request.metrics.finished_time = now
        return request.output(self.token_texts)
