"""What `LLM.generate` returns (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Wall-clock times of one request, in seconds (`time.perf_counter`)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One finished request. `out["text"]` and `out["token_ids"]` work too (nano-vllm style).

    Attributes:
        prompt: the prompt text, or None when the prompt was given as token ids.
        prompt_token_ids: the prompt's token ids.
        token_ids: the generated token ids (a stop string's tokens are cut; a stop token is kept).
        text: the generated text, ending before any stop string.
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
        if key not in ("text", "token_ids", "prompt_token_ids", "finish_reason", "prompt"):
            raise KeyError(key)
        return getattr(self, key)
