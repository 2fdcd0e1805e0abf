"""One request as the scheduler sees it: its tokens, its progress and its KV blocks."""

from __future__ import annotations

import enum
from typing import Literal

import numpy as np

from jaxllm.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]

# The value of a sampled token still on the device (see `Scheduler.commit`).
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted; holds no blocks
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"  # done; its blocks are freed


class Sequence:
    """A request's tokens and state; mutated by the scheduler only.

    The tokens live in one int32 buffer sized for the prompt plus the most tokens the request
    may generate, so slices for hashing and batch building are views, not copies.

    Attributes:
        seq_id: unique within its scheduler (handed out by the scheduler's counter).
        params: the request's sampling parameters.
        max_tokens: the effective output budget, min(params.max_tokens, max_model_len - prompt).
        status: waiting, running or finished.
        num_computed_tokens: tokens whose K/V is in the cache (prefix hits included).
        num_cached_tokens: tokens served from the prefix cache when first scheduled; None
            before that.
        block_table: the ids of the KV blocks holding the sequence, in order.
        block_hashes: chained hashes of the sequence's full blocks computed so far.
        output_token_ids: the generated tokens; the last may be a `PLACEHOLDER` (see
            `pending_index`).
        pending_index: the index in the tokens of the one token still on the device (appended
            by `Scheduler.commit`, given its value by `Scheduler.apply`); None if there is none.
        finish_reason: why it finished ("stop", "length" or "abort"); None while it runs.
        stop_token_ids: tokens that end it once min_tokens were generated (eos unless
            ignore_eos, plus params.stop_token_ids).
        num_preemptions: how many times it was preempted.
    """

    __slots__ = (
        "_tokens",
        "block_hashes",
        "block_table",
        "finish_reason",
        "last_token_id",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_tokens",
        "output_token_ids",
        "params",
        "pending_index",
        "seq_id",
        "status",
        "stop_token_ids",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: np.ndarray,
        params: SamplingParams,
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        num_prompt = len(prompt_token_ids)
        self.seq_id = seq_id
        self.params = params
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self._tokens = np.zeros(num_prompt + max_tokens, dtype=np.int32)
        self._tokens[:num_prompt] = prompt_token_ids
        self.num_prompt_tokens = num_prompt
        self.num_tokens = num_prompt
        self.last_token_id = int(self._tokens[num_prompt - 1])
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.pending_index: int | None = None

    @property
    def token_ids(self) -> np.ndarray:
        """[num_tokens] prompt and output tokens (a read-only view)."""
        view = self._tokens[: self.num_tokens]
        view.flags.writeable = False
        return view

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._tokens[: self.num_prompt_tokens].tolist()

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Appends one generated token (mutates the tokens, never the KV bookkeeping)."""
        self._tokens[self.num_tokens] = token_id
        self.num_tokens += 1
        self.last_token_id = token_id
        self.output_token_ids.append(token_id)

    @property
    def known_output_token_ids(self) -> list[int]:
        """The generated tokens whose values the host has (all but a pending placeholder)."""
        if self.pending_index is None:
            return self.output_token_ids
        return self.output_token_ids[: self.pending_index - self.num_prompt_tokens]

    def append_placeholder(self) -> None:
        """Appends a token whose value the device has not returned yet (`PLACEHOLDER`)."""
        self.pending_index = self.num_tokens
        self.append_token(PLACEHOLDER)

    def fill_placeholder(self, token_id: int) -> int:
        """Gives the pending placeholder its value; returns its output index (0-based)."""
        index = self.pending_index
        self.pending_index = None
        self._tokens[index] = token_id
        output_index = index - self.num_prompt_tokens
        self.output_token_ids[output_index] = token_id
        if index == self.num_tokens - 1:
            self.last_token_id = token_id
        return output_index

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_prompt_tokens}"
            f"+{self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
