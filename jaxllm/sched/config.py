"""The scheduler's settings: one frozen, validated dataclass, and the request limits they set."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxllm.fields import Check, as_int, check_fields

_AT_LEAST_ONE: Check = (as_int, lambda n: n >= 1, "an integer >= 1")
_SIZES = ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_tile")
_CHECKS: dict[str, Check] = dict.fromkeys((*_SIZES, "num_scheduler_steps"), _AT_LEAST_ONE) | {
    "max_model_len": (as_int, lambda n: n >= 2, "an integer >= 2")
}


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler, the block pool and the step plans need to know.

    Attributes:
        num_blocks: KV blocks in the cache (known once the device memory is measured).
        max_num_seqs: the most running sequences, hence the largest decode batch.
        max_num_batched_tokens: the token budget of a prefill step, counted after padding each
            sequence's chunk to whole tiles; a multiple of `prefill_tile`.
        eos_token_ids: tokens that end a request unless its params say `ignore_eos`.
        max_model_len: the longest sequence (prompt plus output) a request may reach.
        prefill_tile: prefill tokens are laid out in tiles of this many tokens of one sequence.
        enable_prefix_caching: reuse cached KV of identical full blocks across requests.
        num_scheduler_steps: decode steps one plan runs on the device (sampling each token
            there) when no request waits and at most `MULTI_STEP_MAX_SEQS` run (`buckets.py`).
        stepwise_masks: such plans give a constrained row each step's own mask (the runner's
            mailbox, `jaxllm.handoff`), so constrained rows take them; else plans of one step.
    """

    num_blocks: int
    block_size: int = 256
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 4096
    prefill_tile: int = 128
    enable_prefix_caching: bool = True
    num_scheduler_steps: int = 1
    stepwise_masks: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        check_fields(self, _CHECKS, prefix="SchedulerConfig.")
        tile = self.prefill_tile
        if self.max_num_batched_tokens < tile or self.max_num_batched_tokens % tile:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens must be a positive multiple of "
                f"prefill_tile={tile}, got {self.max_num_batched_tokens!r}"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks of the longest sequence: the widest block table."""
        return -(-self.max_model_len // self.block_size)

    def stop_tokens(self, stop_token_ids: Sequence[int] | None, ignore_eos: bool) -> frozenset[int]:
        """The tokens that end a request: its stop_token_ids, and eos unless it ignores eos."""
        return frozenset(stop_token_ids or ()) | frozenset(() if ignore_eos else self.eos_token_ids)

    def check_request(
        self, prompt_token_ids: Sequence[int] | np.ndarray, max_tokens: int | None
    ) -> tuple[np.ndarray, int]:
        """The prompt as an array, and the most tokens it may generate here (max_tokens None:
        as many as max_model_len leaves).

        Raises:
            ValueError: a request that could never complete: an empty prompt, ids outside
                [0, 2**31), a prompt of max_model_len tokens or more, or a prompt plus
                max_tokens needing more KV blocks than the whole cache.
        """
        prompt = np.asarray(prompt_token_ids)
        if prompt.ndim != 1 or len(prompt) == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(
                "the prompt is empty or not a list of token ids: prompt_token_ids must be a "
                "non-empty list of token ids"
            )
        if prompt.min() < 0 or prompt.max() >= 2**31:
            raise ValueError("token ids must be in [0, 2**31)")
        num_prompt = len(prompt)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens; max_model_len={self.max_model_len} leaves "
                "no room for an output token"
            )
        room = self.max_model_len - num_prompt
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        # NOTE: the last sampled token is never fed back, so its K/V needs no slot.
        blocks_needed = -(-(num_prompt + max_tokens - 1) // self.block_size)
        if blocks_needed > self.num_blocks:
            raise ValueError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs "
                f"{blocks_needed} KV blocks of {self.block_size} tokens, but the whole cache has "
                f"{self.num_blocks}; shorten the request or give the cache more memory"
            )
        return prompt, max_tokens
