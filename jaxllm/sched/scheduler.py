"""Continuous batching with chunked prefill, prefix caching and preemption by recomputation.

A step is either all prefill or all decode. `schedule()` first gives the step's token budget to
prefill chunks (an unfinished prefill first, then waiting requests in arrival order); only when
no prefill fits does it run one decode step for every running sequence, preempting the newest
ones when the cache has no block left for the oldest. See docs/structure.md, "Host side".

The engine loop: `batch = schedule()`, build the descriptor, run the device step, then
`update(batch, sampled_token_ids)`, which returns the sequences that finished.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

from jaxllm.cache.block_pool import BlockPool, CacheStats, IntegrityError
from jaxllm.cache.eviction import EvictionPolicy
from jaxllm.cache.hashing import extend_block_hashes
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched.config import SchedulerConfig
from jaxllm.sched.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, eq=False)
class ScheduledBatch:
    """The work of one step, one entry per sequence, in row order.

    Attributes:
        is_prefill: prefill step (chunks laid out in tiles) or decode step (one token each).
        seqs: the scheduled sequences.
        start_positions: each sequence's num_computed_tokens when scheduled: the position of
            its first new token.
        num_new_tokens: tokens each sequence computes in this step (its chunk).
        appends: whether each sequence's sampled token is kept; False for prefill chunks that
            do not reach the end of the sequence's tokens.
    """

    is_prefill: bool
    seqs: list[Sequence]
    start_positions: list[int]
    num_new_tokens: list[int]
    appends: list[bool]

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens computed in this step."""
        return sum(self.num_new_tokens)


class Scheduler:
    """Owns the waiting queue, the running list and the block pool.

    Every public method but the queries mutates the queues, the sequences it touches and the
    pool. Not thread-safe.
    """

    def __init__(
        self, config: SchedulerConfig, *, eviction_policy: str | EvictionPolicy = "lru"
    ) -> None:
        self.config = config
        self.block_pool = BlockPool(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            eviction_policy=eviction_policy,
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._live: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._eos = frozenset(config.eos_token_ids)

    # Requests in and out.

    def validate(
        self, prompt_token_ids: SequenceOf[int] | np.ndarray, params: SamplingParams
    ) -> None:
        """Raises ValueError for a request that could never complete; changes nothing.

        Refused: an empty prompt, ids outside [0, 2**31), a prompt of max_model_len tokens or
        more, and a request whose prompt plus max_tokens needs more KV blocks than the whole
        cache.
        """
        self._checked(prompt_token_ids, params)

    def add(
        self, prompt_token_ids: SequenceOf[int] | np.ndarray, params: SamplingParams | None = None
    ) -> Sequence:
        """Queues a request (mutates the waiting queue); raises ValueError as `validate` does."""
        params = params or SamplingParams()
        prompt, max_tokens = self._checked(prompt_token_ids, params)
        stop_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self._eos
        seq = Sequence(
            next(self._seq_ids), prompt, params, max_tokens=max_tokens, stop_token_ids=stop_ids
        )
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq
        return seq

    def _checked(
        self, prompt_token_ids: SequenceOf[int] | np.ndarray, params: SamplingParams
    ) -> tuple[np.ndarray, int]:
        """The prompt as an array and the effective max_tokens, or ValueError."""
        cfg = self.config
        prompt = np.asarray(prompt_token_ids)
        if prompt.ndim != 1 or len(prompt) == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if prompt.min() < 0 or prompt.max() >= 2**31:
            raise ValueError("token ids must be in [0, 2**31)")
        num_prompt = len(prompt)
        if num_prompt >= cfg.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens; max_model_len={cfg.max_model_len} leaves "
                "no room for an output token"
            )
        max_tokens = min(params.max_tokens, cfg.max_model_len - num_prompt)
        # NOTE: the last sampled token is never fed back, so its K/V needs no slot.
        blocks_needed = -(-(num_prompt + max_tokens - 1) // cfg.block_size)
        if blocks_needed > cfg.num_blocks:
            raise ValueError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs "
                f"{blocks_needed} KV blocks of {cfg.block_size} tokens, but the whole cache has "
                f"{cfg.num_blocks}; shorten the request or give the cache more memory"
            )
        return prompt, max_tokens

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finishes `seq` early (the engine found a stop string): frees its blocks.

        A sequence already finished is left as it is.
        """
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq, reason)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finishes the live sequence `seq_id` with reason "abort"; None if there is none."""
        seq = self._live.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    # Queries.

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def stats(self) -> CacheStats:
        return self.block_pool.stats()

    # The step.

    def schedule(self) -> ScheduledBatch | None:
        """Picks the next step's sequences and tokens; None when nothing is left to run.

        Mutates: admits waiting sequences (allocating their blocks, prefix hits included),
        allocates decode slots, and preempts running sequences when blocks run out.
        """
        batch = self._schedule_prefill()
        if batch is None and self.running:
            batch = self._schedule_decode()
        if batch is None and self.waiting:
            # NOTE: unreachable while `add` refuses what can never fit; fail loudly, never hang.
            raise RuntimeError(f"{self.waiting[0]} cannot be admitted into an idle cache")
        return batch

    def update(
        self, batch: ScheduledBatch, sampled_token_ids: SequenceOf[int] | np.ndarray
    ) -> list[Sequence]:
        """Records a step's results; returns the sequences it finished (`commit` + `apply`).

        Args:
            batch: what `schedule()` returned for this step.
            sampled_token_ids: [S >= batch.num_seqs] the step's sampled tokens in row order;
                rows past num_seqs (padding) and rows of unfinished prefill chunks are ignored.
        """
        finished = self.commit(batch)
        finished += [seq for seq in self.apply(batch, sampled_token_ids) if seq not in finished]
        return finished

    def commit(self, batch: ScheduledBatch) -> list[Sequence]:
        """Records what a step computed before its sampled tokens are known.

        The engine calls it right after dispatching the step, so the next step can be scheduled
        while this one runs on the device; `apply` later gives the tokens their values. Between
        the two, each appending sequence ends in a `PLACEHOLDER` token, which the next step's
        descriptor reads from the device instead. Call `apply` for the previous step first, so
        every token this step computed is known when its blocks are hashed.

        Mutates: advances each running sequence's computed tokens, enters newly full blocks into
        the prefix cache, appends placeholders, and finishes (frees) the sequences that reach
        their max_tokens. Returns those.
        """
        size = self.config.block_size
        caching = self.config.enable_prefix_caching
        finished: list[Sequence] = []
        for seq, start, count, append in zip(
            batch.seqs, batch.start_positions, batch.num_new_tokens, batch.appends, strict=True
        ):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = computed = start + count
            if caching and computed // size > start // size:
                token_ids = seq.token_ids[:computed]
                extend_block_hashes(seq.block_hashes, token_ids, size)
                self.block_pool.cache_blocks(
                    seq.block_table, token_ids, seq.block_hashes, start // size, computed // size
                )
            if not append:
                continue
            seq.append_placeholder()
            if seq.num_output_tokens >= seq.max_tokens:
                self._release(seq, "length")
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished

    def apply(
        self, batch: ScheduledBatch, sampled_token_ids: SequenceOf[int] | np.ndarray
    ) -> list[Sequence]:
        """Gives the placeholders of a committed step their sampled values; returns the
        sequences that a stop token finished.

        Every sequence that `commit` gave a placeholder gets its value, also one preempted,
        finished or aborted since: a preempted one keeps it and prefills it on resumption.
        A stop token (eos unless ignored, or a stop_token_id, once min_tokens are out) finishes
        a live sequence with "stop", and turns a "length" finish on the same token into "stop".
        """
        tokens = np.asarray(sampled_token_ids)[: batch.num_seqs].tolist()
        finished: list[Sequence] = []
        for seq, append, token in zip(batch.seqs, batch.appends, tokens, strict=True):
            if not append or seq.pending_index is None:
                continue
            num_output = seq.fill_placeholder(token) + 1
            if token not in seq.stop_token_ids or num_output < seq.params.min_tokens:
                continue
            if seq.is_finished:
                if seq.finish_reason == "length":
                    seq.finish_reason = "stop"
            else:
                self.finish(seq, "stop")
                finished.append(seq)
        return finished

    def _schedule_prefill(self) -> ScheduledBatch | None:
        cfg = self.config
        tile = cfg.prefill_tile
        budget = cfg.max_num_batched_tokens
        seqs: list[Sequence] = []
        starts: list[int] = []
        counts: list[int] = []

        def add_chunk(seq: Sequence) -> None:
            nonlocal budget
            remaining = seq.num_tokens - seq.num_computed_tokens
            padded = -(-remaining // tile) * tile
            count = remaining if padded <= budget else budget
            budget -= min(padded, budget)
            seqs.append(seq)
            starts.append(seq.num_computed_tokens)
            counts.append(count)

        for seq in self.running:
            if budget == 0:
                break
            if seq.num_tokens - seq.num_computed_tokens > 1:
                add_chunk(seq)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            add_chunk(seq)
        if not seqs:
            return None
        appends = [s + c == seq.num_tokens for seq, s, c in zip(seqs, starts, counts, strict=True)]
        return ScheduledBatch(True, seqs, starts, counts, appends)

    def _admit(self, seq: Sequence) -> bool:
        """Gives `seq` blocks for all its tokens, reusing cached ones; False if they don't fit."""
        pool = self.block_pool
        size = self.config.block_size
        hit: list[int] = []
        if self.config.enable_prefix_caching:
            # NOTE: at least the last token is computed, so the step samples from its logits;
            # the hit stops at a block boundary so no write ever lands in a shared block.
            max_blocks = (seq.num_tokens - 1) // size
            token_ids = seq.token_ids
            extend_block_hashes(seq.block_hashes, token_ids[: max_blocks * size], size)
            hit = pool.find_cached_prefix(token_ids, seq.block_hashes, max_blocks)
        table = pool.allocate(hit, -(-seq.num_tokens // size) - len(hit))
        if table is None:
            return False
        num_hit_tokens = len(hit) * size
        pool.record_query(seq.num_tokens, num_hit_tokens)
        seq.block_table = table
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        return True

    def _schedule_decode(self) -> ScheduledBatch | None:
        pool = self.block_pool
        running = self.running
        scheduled: list[Sequence] = []
        index = 0
        while index < len(running):
            seq = running[index]
            if pool.append_slots(seq.block_table, seq.num_tokens):
                scheduled.append(seq)
                index += 1
            else:
                self._preempt(running.pop())
        if not scheduled:
            return None
        num = len(scheduled)
        starts = [seq.num_tokens - 1 for seq in scheduled]
        return ScheduledBatch(False, scheduled, starts, [1] * num, [True] * num)

    def _preempt(self, seq: Sequence) -> None:
        """Returns a running sequence to the front of the waiting queue, freeing its blocks.

        It keeps its tokens (generated ones included) and its block hashes; when admitted again
        it prefills everything, typically from the prefix cache.
        """
        self.block_pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_pool.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._live[seq.seq_id]

    # Invariants.

    def check_integrity(self) -> None:
        """Raises `IntegrityError` unless the scheduler's and the pool's invariants hold."""

        def require(condition: bool, message: str) -> None:
            if not condition:
                raise IntegrityError(message)

        cfg = self.config
        pool = self.block_pool
        pool.check_integrity(seq.block_table for seq in self.running)
        ids = [seq.seq_id for seq in self.running] + [seq.seq_id for seq in self.waiting]
        require(len(ids) == len(set(ids)), "a sequence is queued twice")
        require(set(ids) == set(self._live), "the live set differs from the queues")
        require(len(self.running) <= cfg.max_num_seqs, "more running sequences than max_num_seqs")
        for seq in self.waiting:
            require(seq.status is SequenceStatus.WAITING, f"{seq} in the waiting queue")
            require(not seq.block_table and seq.num_computed_tokens == 0, f"{seq} holds blocks")
        size = cfg.block_size
        for seq in self.running:
            require(seq.status is SequenceStatus.RUNNING, f"{seq} in the running list")
            num_full = seq.num_computed_tokens // size
            require(
                -(-seq.num_computed_tokens // size) <= len(seq.block_table)
                and len(seq.block_table) <= -(-seq.num_tokens // size),
                f"{seq}: block table does not match its tokens",
            )
            require(seq.num_computed_tokens < seq.num_tokens, f"{seq}: nothing left to compute")
            for index, block_id in enumerate(seq.block_table):
                block_hash = pool.block_hash(block_id)
                if index < num_full:
                    require(
                        block_hash is None or block_hash == seq.block_hashes[index],
                        f"{seq}: block {block_id} caches another prefix",
                    )
                else:
                    # NOTE: a block still being written belongs to its sequence alone.
                    require(
                        block_hash is None and pool.ref_count(block_id) == 1,
                        f"{seq}: block {block_id} is written but shared or cached",
                    )
