"""What `LLM.generate` returns, and what the engine counts of its steps (pure Python)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, field, fields, replace
from typing import Any, NamedTuple

import numpy as np


@dataclass
class RequestMetrics:
    """Wall-clock times of one request, in seconds (`time.perf_counter`)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class Logprob(NamedTuple):
    """A token's log-probability under the model (vLLM's `Logprob`).

    Attributes:
        logprob: log-softmax of the model's raw logits (before temperature and filters), or
            of the logits sampled from with `logprobs_mode="processed_logprobs"`.
        rank: the sampled token's: the tokens at least as likely, itself included (vLLM's count);
            a top token's: its place among them.
        decoded_token: the token decoded alone; None with `SamplingParams.detokenize` off.
    """

    logprob: float
    rank: int
    decoded_token: str | None


class SampleLogprobs(Sequence):
    """For each generated token, {token id: Logprob} of the token and of the top alternatives
    (vLLM's list of dicts), each dict built when first read from the rows the device returned
    (`sampler.token_logprobs`). Pickles as a plain list.

    NOTE: built all at once they cost the host about 5 us a token, and their objects slow the
    garbage collector; vLLM's FlatLogprobs defers them likewise.
    """

    def __init__(
        self,
        tokens: list[int],
        rows: np.ndarray,
        wanted: int,
        texts: Callable[[list[int]], Mapping[int, str | None]],
    ) -> None:
        self._tokens, self._rows, self._wanted, self._texts = tokens, rows, wanted, texts
        self._entries: list[dict[int, Logprob] | None] = [None] * len(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        entries = self._entries[index]
        if entries is None:
            entries = self._entries[index] = self._build(index)
        return entries

    def _build(self, index: int) -> dict[int, Logprob]:
        token, row, wanted = self._tokens[index], self._rows[index], self._wanted
        num_top = (len(row) - 2) // 2
        ids = row[2 : 2 + wanted].astype(np.int64).tolist()
        values = row[2 + num_top : 2 + num_top + wanted].tolist()
        text = self._texts([token, *ids])
        entries = {token: Logprob(float(row[0]), int(row[1]), text[token])}  # first, as vLLM's
        for rank, (i, v) in enumerate(zip(ids, values, strict=True), 1):
            entries[i] = Logprob(v, rank, text[i])
        return entries

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleLogprobs | list) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


# The same for each prompt token, None for the first.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's names).

    Attributes:
        index: the completion's index among the request's `n`.
        text: the generated text (`token_ids` decoded), ending before any stop string or
            stop token unless `include_stop_str_in_output`; "" without `detokenize`.
        token_ids: the generated token ids; a stop token is kept, and so is the token that
            completed a stop string.
        cumulative_logprob: the sum of the generated tokens' logprobs; None unless the request
            asked for `logprobs`.
        logprobs: for each generated token, {token id: Logprob} of the token and of the
            `logprobs` most likely ones; None unless asked for.
        finish_reason: "stop" (eos, a stop token or a stop string) or "length" (max_tokens or
            max_model_len).
        stop_reason: the stop string or stop token id that ended it; None for eos and length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        """Whether the completion ended (always, offline; vLLM's method)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One finished request: its completions. `text`, `token_ids` and `finish_reason` are those of
    the first completion; `out["text"]` and the like work too (nano-vllm style).

    Attributes:
        prompt: the prompt text; None for token ids given without their text.
        prompt_token_ids: the prompt's token ids.
        outputs: the completions, by index.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        metrics: time to first token and total time.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, {token id: Logprob} of each
            prompt token and of the most likely ones (None for the first token).
        finished: True: outputs come once the request finished (vLLM's field).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics = field(repr=False)
    prompt_logprobs: PromptLogprobs | None = None
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    def __getitem__(self, key: str) -> Any:
        if key in {"text", "token_ids", "finish_reason", *(f.name for f in fields(self))}:
            return getattr(self, key)
        raise KeyError(key)


class StreamDelta(NamedTuple):
    """What `LLM.stream` yields: the new text and the new token ids of completion `index` since
    its last delta; its last delta also says why it finished (`CompletionOutput`'s).

    Attributes:
        logprobs: with `SamplingParams.logprobs`, the new tokens' entries of
            `CompletionOutput.logprobs`; else None.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, `RequestOutput.prompt_logprobs`
            in completion 0's first delta; else None.
    """

    text: str
    token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Sequence[dict[int, Logprob]] | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class StepStats:
    """Tokens and seconds of one kind of step (prefill or decode), accumulated. A step is one
    plan (`Engine.step`): a decode plan may run several forward passes (`forward_passes`)."""

    tokens: int = 0
    steps: int = 0
    forward_passes: int = 0
    # The wall time of `Engine.step`.
    seconds: float = 0.0
    # Of it, in `ModelRunner.execute`.
    dispatch_seconds: float = 0.0
    # Of it, reading the previous step's tokens, booked under this step's kind: the first
    # decode step after a prefill waits for that prefill.
    wait_seconds: float = 0.0
    # Of the dispatch, filling structured outputs' token masks while the device runs the
    # forward pass (a constrained step's dispatch also applies the step before it and plans
    # the next, `Engine._masks`).
    masks_seconds: float = 0.0
    # The steps whose forward pass was done before that host work (the device waited).
    masks_late_steps: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def __sub__(self, other: StepStats) -> StepStats:
        return StepStats(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class EngineStats:
    prefill: StepStats = field(default_factory=StepStats)
    decode: StepStats = field(default_factory=StepStats)

    def snapshot(self) -> EngineStats:
        return EngineStats(replace(self.prefill), replace(self.decode))

    def since(self, before: EngineStats) -> dict[str, float]:
        """Throughput and the parts of a decode step's (a plan's) wall time (handing it to the
        device, waiting for tokens) since `before`."""
        prefill, decode = self.prefill - before.prefill, self.decode - before.decode
        per_step = lambda seconds: 1e3 * seconds / decode.steps if decode.steps else 0.0
        passes = decode.forward_passes
        return {
            "decode_forward_passes": passes,
            "decode_ms_per_forward_pass": 1e3 * decode.seconds / passes if passes else 0.0,
            "prefill_tok_s": prefill.tokens_per_second,
            "decode_tok_s": decode.tokens_per_second,
            "prefill_steps": prefill.steps,
            "decode_steps": decode.steps,
            "decode_ms_per_step": per_step(decode.seconds),
            "decode_dispatch_ms_per_step": per_step(decode.dispatch_seconds),
            "decode_wait_ms_per_step": per_step(decode.wait_seconds),
            "decode_masks_ms_per_step": per_step(decode.masks_seconds),
            "decode_masks_late_steps": decode.masks_late_steps,
        }
