"""One request as the scheduler sees it: its tokens, its progress and its KV blocks."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Literal

import numpy as np

from jaxllm.sampling_params import SamplingParams
from jaxllm.sched.processors import SequenceProcessors

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]

# Feeds one generated token to a request's stop strings; True once the text holds one of them
# (the engine's `detokenizer.StopStrings`, which needs the tokenizer).
StopStringCheck = Callable[[int], bool]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted; holds no blocks
    RUNNING = "running"  # holds blocks; prefilling or decoding
    SAMPLING_LAST = "sampling last"  # a planned step samples its last token; holds no blocks
    FINISHED = "finished"  # done; its blocks are freed


class Sequence:
    """A request's tokens and state; mutated by the scheduler only.

    The tokens live in one int32 buffer sized for the prompt plus the most tokens the request
    may generate, so slices for hashing and batch building are views, not copies.

    Attributes:
        seq_id: unique within its scheduler (handed out by the scheduler's counter).
        max_tokens: the effective output budget, min(params.max_tokens, max_model_len - prompt).
        num_tokens: prompt and generated tokens the host has.
        num_computed_tokens: tokens whose K/V is in the cache, or is computed by a step already
            planned (prefix hits included). While a planned step samples the next token, it
            equals `num_tokens`: the one token on its way back from the device.
        num_cached_tokens: tokens served from the prefix cache when first scheduled; None
            before that.
        block_table: the ids of the KV blocks holding the sequence, in order.
        block_hashes: chained hashes of the sequence's full blocks computed so far.
        stop_token_ids: tokens that end it once min_tokens were generated (eos unless
            ignore_eos, plus params.stop_token_ids).
        output_logprobs: with params.logprobs, each output token's row of the device's
            logprobs (`steps.StepResult.logprobs`).
        prompt_logprobs: with params.prompt_logprobs, the logprobs rows of prompt tokens 1, 2, ...
            computed so far.
        processors: its logits processors' host side (slot, bad words); None when its
            params ask for none.
        grammar: the matcher of its structured output (`jaxllm.structured.SequenceGrammar`:
            `ready`, `matcher`, `is_terminated`; `structured.accept_tokens` advances it); None
            when it has none.
        parent: another completion of the same request, whose prompt this one waits to find
            in the prefix cache while it is being prefilled; None for the first.
    """

    __slots__ = (
        "_tokens", "block_hashes", "block_table", "finish_reason", "grammar", "max_tokens",
        "num_cached_tokens", "num_computed_tokens", "num_preemptions", "num_prompt_tokens",
        "num_tokens", "output_logprobs", "output_token_ids", "params", "parent", "processors",
        "prompt_logprobs", "seq_id", "status", "stop_strings", "stop_token_ids",
    )  # fmt: skip

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: np.ndarray,
        params: SamplingParams,
        *,
        max_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        stop_strings: StopStringCheck | None = None,
        processors: SequenceProcessors | None = None,
        grammar=None,
    ) -> None:
        num_prompt = len(prompt_token_ids)
        self.seq_id = seq_id
        self.params = params
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self.stop_strings = stop_strings
        self.processors = processors
        self.grammar = grammar
        self._tokens = np.zeros(num_prompt + max_tokens, dtype=np.int32)
        self._tokens[:num_prompt] = prompt_token_ids
        self.num_prompt_tokens = num_prompt
        self.num_tokens = num_prompt
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[np.ndarray] = []
        self.parent: Sequence | None = None
        self.prompt_logprobs: list[np.ndarray] = []
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0

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

    def stops_at(self, token: int) -> bool:
        """Whether `token`, its newest output token, is a stop token once min_tokens are out."""
        return token in self.stop_token_ids and self.num_output_tokens >= self.params.min_tokens

    def finish_reason_at(self, token: int, last: bool = True) -> FinishReason | None:
        """Why it ends with its newest token `token` (`last`: the last its grammar read), as
        vLLM decides: a stop token (its text searched for stop strings only where it is
        output, `include_stop_str_in_output`), a stop string, a grammar that admits nothing
        more, max_tokens ("length"); None: it goes on. Each "stop" holds on the last token
        max_tokens allows too: a grammar's end stands for the eos vLLM would sample after it."""
        if self.stops_at(token):
            if self.stop_strings is not None and self.params.include_stop_str_in_output:
                self.stop_strings(token)
            return "stop"
        # NOTE: the stop strings see every other token, so their text stays whole.
        if self.stop_strings is not None and self.stop_strings(token):
            return "stop"
        if last and self.grammar and self.grammar.is_terminated:
            if self.grammar.error:  # NOTE: it stops as in vLLM, which logs it too
                logger.warning("%s stops: its grammar failed: %s", self, self.grammar.error)
            return "stop"
        return "length" if self.num_output_tokens >= self.max_tokens else None

    def token_at(self, position: int) -> int:
        """The token at `position`, or 0 for the one still on its way back from the device."""
        return int(self._tokens[position])

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs, and not all are computed yet."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        """Running, with prompt tokens not yet computed."""
        running = self.status is SequenceStatus.RUNNING
        return running and self.num_computed_tokens < self.num_prompt_tokens

    def append_token(self, token_id: int, logprobs: np.ndarray | None = None) -> None:
        """Appends one generated token, and its logprobs if the sequence asked for them
        (mutates the tokens, never the KV bookkeeping)."""
        self._tokens[self.num_tokens] = token_id
        self.num_tokens += 1
        self.output_token_ids.append(token_id)
        if logprobs is not None and self.params.logprobs is not None:
            self.output_logprobs.append(logprobs)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_prompt_tokens}"
            f"+{self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
