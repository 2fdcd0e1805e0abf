"""What `LLM.generate` returns (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple


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
        logprob: log-softmax of the model's raw logits (before temperature and filters).
        rank: 1 + the number of tokens the model found more likely.
        decoded_token: the token decoded alone.
    """

    logprob: float
    rank: int
    decoded_token: str


# For each generated token: its own Logprob and those of the top alternatives, by token id.
SampleLogprobs = list[dict[int, Logprob]]
# The same for each prompt token, None for the first.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's names).

    Attributes:
        index: the completion's index among the request's `n`.
        text: the generated text (`token_ids` decoded), ending before any stop string.
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


@dataclass
class RequestOutput:
    """One finished request: its completions. `text`, `token_ids` and `finish_reason` are those of
    the first completion; `out["text"]` and the like work too (nano-vllm style).

    Attributes:
        prompt: the prompt text, or None when the prompt was given as token ids.
        prompt_token_ids: the prompt's token ids.
        outputs: the completions, by index.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        metrics: time to first token and total time.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, {token id: Logprob} of each
            prompt token and of the most likely ones (None for the first token).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics = field(repr=False)
    prompt_logprobs: PromptLogprobs | None = None

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
        if key in _SHORTCUTS or key in {f.name for f in fields(self)}:
            return getattr(self, key)
        raise KeyError(key)


_SHORTCUTS = frozenset({"text", "token_ids", "finish_reason"})


class StreamDelta(NamedTuple):
    """What `LLM.stream` yields: the new text and the new token ids of completion `index` since
    its last delta."""

    text: str
    token_ids: list[int]
    index: int = 0
