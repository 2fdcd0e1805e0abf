"""Per-request sampling settings, validated at construction (pure Python, no jax)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    Attributes:
        temperature: 0 means greedy; otherwise logits are divided by it. Range [0, inf).
        top_k: keep the k most likely tokens; 0 (or -1) keeps all.
        top_p: keep the smallest set of tokens whose probability reaches top_p. Range (0, 1].
        min_p: drop tokens whose probability is below min_p times the top one. Range [0, 1].
        max_tokens: generate at most this many tokens. Range [1, inf).
        min_tokens: ignore eos and stop tokens until this many were generated.
        ignore_eos: keep generating after the eos token (still stops at max_tokens).
        stop: strings that end the output; the text ends before the stop string.
        stop_token_ids: token ids that end the output (kept in `token_ids`).
        seed: makes this request's samples reproducible, whatever else is in the batch.
        skip_special_tokens: drop special tokens when decoding the text.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    # NOTE: set by the engine (never by users) so that an unseeded request still draws from a
    # stream of its own; excluded from equality so user-visible params compare as expected.
    _derived_seed: int | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

        def fail(name: str, allowed: str) -> None:
            value = getattr(self, name)
            raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")

        if not _is_real(self.temperature) or self.temperature < 0 or math.isinf(self.temperature):
            fail("temperature", "a finite number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "an integer >= 0 (0 or -1 keeps every token)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "a number in (0, 1]")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "a number in [0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "a list of integers >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            fail("seed", "None or an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sampling_seed(self) -> int:
        """The seed the device sampler uses for this request (user seed, else engine-derived)."""
        if self.seed is not None:
            return self.seed
        return self._derived_seed or 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
