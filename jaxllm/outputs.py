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


@dataclass
class RequestOutput:
    """One finished request. `out["text"]` and `out["token_ids"]` work too (nano-vllm style).

    Attributes:
        prompt: the prompt text, or None when the prompt was given as token ids.
        prompt_token_ids: the prompt's token ids.
        token_ids: the generated token ids; a stop token is kept, and so is the token that
            completed a stop string.
        text: the generated text (`token_ids` decoded), ending before any stop string.
        finish_reason: "stop" (eos, a stop token or a stop string) or "length" (max_tokens or
            max_model_len).
        num_cached_tokens: prompt tokens whose KV came from the prefix cache.
        metrics: time to first token and total time.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    metrics: RequestMetrics = field(repr=False)

    def __getitem__(self, key: str) -> Any:
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


class StreamDelta(NamedTuple):
    """What `LLM.stream` yields: the new text and the new token ids since the last delta."""

    text: str
    token_ids: list[int]
