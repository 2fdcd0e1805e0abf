"""Continuous batching with chunked prefill, prefix caching and preemption by recomputation.

A step is all prefill (an unfinished prefill first, then waiting requests in arrival order) or,
when no prefill fits, one decode token for every running sequence, preempting the newest ones
when the cache has no block left for the oldest. See docs/structure.md, "Host side".

A step is three calls: `plan = schedule()`, the device runs it, `update(plan, token_ids)` applies
its sampled tokens. The engine plans step N + 1 before it updates step N, so `schedule` records
what a plan computes (also a token still on the device) and `update` only what the tokens bring.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import numpy as np

from jaxllm.cache.block_pool import BlockPool, CacheStats
from jaxllm.cache.eviction import EvictionPolicy
from jaxllm.cache.hashing import extend_block_hashes
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched.buckets import BucketLadder
from jaxllm.sched.config import SchedulerConfig
from jaxllm.sched.integrity import check_integrity
from jaxllm.sched.plan import StepPlan, keep_prompt_logprobs, plan_step
from jaxllm.sched.processors import ProcessorSlots, SequenceProcessors, changes_logits
from jaxllm.sched.sequence import FinishReason, Sequence, SequenceStatus, StopStringCheck
from jaxllm.structured import accept_tokens


class Scheduler:
    """Owns the waiting queue, the running list and the block pool.

    Every public method but the queries mutates the queues, the sequences it touches and the
    pool. Not thread-safe.

    Args:
        ladder: the step shapes; default `BucketLadder` of `config` (a width per power of two).
        eviction_policy: the block pool's (see `jaxllm.cache.eviction`).
        clock: the time the policy sees (`BlockPool`); the simulator gives its own.
        outlines: plans without the device's arrays (`plan_step`'s outlines), for the simulator.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        ladder: BucketLadder | None = None,
        eviction_policy: str | EvictionPolicy = "lru",
        clock: Callable[[], float] = time.monotonic,
        outlines: bool = False,
    ) -> None:
        self.config = config
        self.outlines = outlines
        self.ladder = ladder or BucketLadder.from_config(config)
        self.block_pool = BlockPool(
            config.num_blocks, config.block_size, eviction_policy=eviction_policy, clock=clock,
            enable_prefix_caching=config.enable_prefix_caching,
        )  # fmt: skip
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # NOTE: sequences a planned step samples the last token of: their K/V is never read
        # again, so their blocks go back when that step is planned; `update` finishes them.
        self.sampling_last: list[Sequence] = []
        self._queues = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                        SequenceStatus.SAMPLING_LAST: self.sampling_last}  # fmt: skip
        self.num_preemptions = 0
        self.slots = ProcessorSlots(config.max_num_seqs)  # the logits processors'
        self.num_constrained = 0  # live sequences with a grammar
        self._live: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._skipped_compiling = False  # the last prefill plan passed grammars still compiling

    def new_sequence(
        self,
        prompt_token_ids: SequenceOf[int] | np.ndarray,
        params: SamplingParams | None = None,
        stop_strings: StopStringCheck | None = None,
        processors: SequenceProcessors | None = None,
        grammar=None,
    ) -> Sequence:
        """A request as a `Sequence`, not yet queued (`add` queues it); changes nothing else.
        `processors` and `grammar`: see `Sequence`.

        Raises:
            ValueError: a request that could never complete (`SchedulerConfig.check_request`).
        """
        params = params or SamplingParams()
        prompt, max_tokens = self.config.check_request(prompt_token_ids, params.max_tokens)
        stop_ids = self.config.stop_tokens(params.stop_token_ids, params.ignore_eos)
        return Sequence(
            next(self._seq_ids), prompt, params, max_tokens=max_tokens, stop_token_ids=stop_ids,
            stop_strings=stop_strings, processors=processors, grammar=grammar,
        )  # fmt: skip

    def add(self, seq: Sequence) -> None:
        """Queues a sequence made by `new_sequence` (mutates the waiting queue)."""
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq
        self.slots.count(seq, 1)
        self.num_constrained += seq.grammar is not None

    def abort(self, seq_id: int) -> Sequence | None:
        """Finishes the live sequence `seq_id` with reason "abort"; None if there is none."""
        seq = self._live.get(seq_id)
        if seq is not None:
            self._finish(seq, "abort")
        return seq

    def reset(self) -> None:
        """Aborts every live sequence and empties the block pool, prefix cache included: what is
        left after a step failed midway, when neither the pool's records nor the KV they point
        to can be trusted."""
        for seq in self._live.values():
            seq.block_table, seq.status, seq.finish_reason = [], SequenceStatus.FINISHED, "abort"
            self.slots.release(seq)  # NOTE: every slot is free again below
        for queue in (self.waiting, self.running, self.sampling_last, self._live):
            queue.clear()
        self.slots.reset()
        self.num_constrained = 0
        self.block_pool.reset()  # last: an eviction policy may raise

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def needs_host_tokens(self) -> bool:
        """A live sequence has bad words of several tokens, whose bans the plan computes from
        its output: the engine applies a step's tokens before it plans the next."""
        return self.slots.num_needing_host_tokens > 0

    def stats(self) -> CacheStats:
        return self.block_pool.stats()

    def schedule(self) -> StepPlan | None:
        """Plans the next step; None when nothing is left to run (or what is left waits for
        its grammar to compile).

        Mutates: admits waiting sequences (blocks allocated, prefix hits first), allocates
        decode slots, preempts when blocks run out, and records what the plan computes: tokens,
        and newly full blocks with known tokens entered into the prefix cache (the step writes
        them before any later one reads them). A sequence whose last token it samples leaves the
        running list and gives its blocks back.
        """
        chunks = self._schedule_prefill() or self._schedule_decode()
        if chunks is None:
            if self._skipped_compiling:
                return None  # what waits needs its grammar, compiling in the background
            if self.waiting and not self.running:
                # NOTE: unreachable while `new_sequence` refuses what can never fit; fail loudly.
                raise RuntimeError(f"{self.waiting[0]} cannot be admitted into an idle cache")
            return None
        return self._plan(*chunks)

    def _plan(self, kind: str, seqs: list[Sequence], counts: list[int]) -> StepPlan:
        """The plan of `counts[i]` new tokens of each of `seqs`, recorded as computed."""
        starts = [seq.num_computed_tokens for seq in seqs]
        num_steps = self.ladder.num_steps if kind == "decode" and max(counts) > 1 else 1
        all_rows = kind == "prefill" and seqs[0].wants_prompt_logprobs  # then it is alone
        shape = (self.ladder, self.config.block_size, kind, seqs, starts, counts, num_steps)
        new_slots = self.slots.take_new() if self.slots.num_held else None
        plan = plan_step(*shape, all_rows, new_slots, outline=self.outlines)
        for seq, start, count, samples in zip(seqs, starts, counts, plan.samples, strict=True):
            end = seq.num_computed_tokens = start + count
            self._cache_full_blocks(seq, start, min(end, seq.num_tokens))
            if samples and end + 1 - seq.num_prompt_tokens >= seq.max_tokens:
                # NOTE: its last token planned, its blocks go back (this step writes them first)
                self.running.remove(seq)
                self._free(seq)
                seq.status = SequenceStatus.SAMPLING_LAST
                self.sampling_last.append(seq)
        return plan

    def update(
        self,
        plan: StepPlan,
        sampled_token_ids: SequenceOf[int] | np.ndarray,
        logprobs: np.ndarray | None = None,
        accepted: dict[int, int] | None = None,
    ) -> list[Sequence]:
        """Applies a step's sampled tokens; returns the sequences that finished.

        Args:
            plan: what `schedule()` returned for the step.
            sampled_token_ids: [S >= plan.num_seqs] the step's sampled tokens in row order, or
                [K, S] those of a decode plan's K steps (row i's own: the first
                `plan.num_new_tokens[i]`); padding rows and rows that do not sample are ignored.
            logprobs: [S, 2 + 2 * max_logprobs] the sampled tokens' logprobs of a plan with
                `plan.logprobs` (`sampler.token_logprobs`), kept by the sequences that asked.
            accepted: the tokens each constrained row's grammar read (`accept_tokens`, or
                `handoff.StepwiseMasks.kept` for a plan of several steps); None: read here.

        Mutates: appends each sampled token to its sequence (also to one preempted since),
        caches the block it completes if a later planned step computes it, and finishes the
        sequences that stop (`Sequence.finish_reason_at`); those finished since the plan are
        skipped. A constrained row keeps the tokens its grammar read: where it read fewer, its
        end (`finish_reason_at`) came at the last.
        """
        tokens, counts = plan.row_tokens(sampled_token_ids)
        finished: list[Sequence] = []
        if plan.all_rows and logprobs is not None:
            keep_prompt_logprobs(plan, logprobs)
        rows = zip(plan.seqs, plan.samples, tokens, counts, strict=True)
        if accepted is None:
            accepted = accept_tokens(plan, tokens) if self.num_constrained else {}
        for index, (seq, samples, row, count) in enumerate(rows):
            kept = accepted.get(index, count)
            for num_read, token in enumerate(row[:kept] if samples and not seq.is_finished else []):
                position = seq.num_tokens
                seq.append_token(token, None if logprobs is None else logprobs[index])
                if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens > position:
                    self._cache_full_blocks(seq, position, position + 1)
                reason = seq.finish_reason_at(token, last=num_read + 1 == kept)
                if reason is not None:
                    self._finish(seq, reason)
                    finished.append(seq)
                    break
            if kept < count and not seq.is_finished:  # NOTE: a grammar reads fewer at its end
                raise RuntimeError(f"{seq} kept {kept} of its {count} tokens and goes on")
        return finished

    def _cache_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Enters the blocks of `seq` that tokens `start` .. `end - 1` complete into the prefix
        cache (their tokens are known; their K/V is computed by a planned step)."""
        size = self.config.block_size
        first, last = start // size, end // size
        if not self.config.enable_prefix_caching or last <= first:
            return
        tokens, hashes, table = seq.token_ids[:end], seq.block_hashes, seq.block_table
        extend_block_hashes(hashes, tokens, size)
        self.block_pool.cache_blocks(table, tokens, hashes, first, last, seq.params.extra_args)

    def _schedule_prefill(self) -> tuple | None:
        """("prefill", seqs, counts) of the step's prefill chunks, or None."""
        cfg = self.config
        tile, budget = cfg.prefill_tile, cfg.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []

        def add_chunk(seq: Sequence) -> None:
            nonlocal budget
            if seq.wants_prompt_logprobs:  # every row sampled: it goes alone
                budget = self.ladder.all_rows_tokens
            remaining = seq.num_tokens - seq.num_computed_tokens
            padded = -(-remaining // tile) * tile
            count = remaining if padded <= budget else budget
            budget -= min(padded, budget)
            seqs.append(seq)
            counts.append(count)

        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        alone = [seq for seq in prefilling if seq.wants_prompt_logprobs][:1]
        for seq in alone or prefilling:
            if budget == 0:
                break
            add_chunk(seq)
        if alone:
            return "prefill", seqs, counts
        compiling = []  # waiting for their grammars: those behind them go first
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.grammar is not None and not seq.grammar.ready:
                compiling.append(self.waiting.popleft())
                continue
            if seq.wants_prompt_logprobs and seqs:
                break
            if cfg.enable_prefix_caching and seq.parent is not None and seq.parent.is_prefilling:
                break  # its prompt's blocks will be in the prefix cache once the parent's are
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self.running.append(seq)
            add_chunk(seq)
            if seq.wants_prompt_logprobs:
                break
        self.waiting.extendleft(reversed(compiling))
        self._skipped_compiling = bool(compiling)
        return ("prefill", seqs, counts) if seqs else None

    def _admit(self, seq: Sequence) -> bool:
        """Gives `seq` blocks for all its tokens, reusing cached ones; False if they don't fit."""
        pool, size = self.block_pool, self.config.block_size
        hit: list[int] = []
        looks_up = self.config.enable_prefix_caching and not seq.wants_prompt_logprobs
        if looks_up:
            # NOTE: at least the last token is computed, so the step samples from its logits;
            # the hit stops at a block boundary so no write ever lands in a shared block.
            max_blocks = (seq.num_tokens - 1) // size
            extend_block_hashes(seq.block_hashes, seq.token_ids[: max_blocks * size], size)
            hit = pool.find_cached_prefix(seq.token_ids, seq.block_hashes, max_blocks)
        table = pool.allocate(hit, -(-seq.num_tokens // size) - len(hit))
        if table is None:
            return False
        num_hit_tokens = len(hit) * size
        if looks_up:  # NOTE: as vLLM counts them: a request that cannot hit is no query
            pool.record_query(seq.num_tokens, num_hit_tokens)
        seq.block_table = table
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        self.slots.assign(seq)
        return True

    def _schedule_decode(self) -> tuple | None:
        """("decode", seqs, counts): one token for every running sequence, preempting the
        newest when blocks run out, or several (`_multi_step_counts`); or None."""
        running = self.running
        counts = self._multi_step_counts()
        if counts is not None:
            return "decode", list(running), counts
        index = 0
        while index < len(running):
            seq = running[index]
            if self.block_pool.append_slots(seq.block_table, seq.num_computed_tokens + 1):
                index += 1
            else:
                self._preempt(running.pop())
        return ("decode", list(running), [1] * len(running)) if running else None

    def _multi_step_counts(self) -> list[int] | None:
        """The tokens each running sequence computes in a plan of `ladder.num_steps` decode
        steps (as many as it has left), their blocks allocated; None, changing nothing, when
        something waits, more than `ladder.multi_step_max_seqs` run, one wants logprobs or
        logits processing (`changes_logits`), one is constrained without `stepwise_masks`, or
        the blocks are not free."""
        running, steps, pool = self.running, self.ladder.num_steps, self.block_pool
        if self.waiting or not 0 < len(running) <= self.ladder.multi_step_max_seqs:
            return None
        if any(
            seq.params.logprobs is not None
            or changes_logits(seq)
            or (seq.grammar is not None and not self.config.stepwise_masks)
            for seq in running
        ):
            return None
        ends, needed = [], 0
        for seq in running:  # NOTE: position num_prompt + max_tokens - 1 is the last one sampled
            last = seq.num_prompt_tokens + seq.max_tokens - 1
            end = min(seq.num_computed_tokens + steps, last)
            ends.append(end)
            needed += max(0, -(-end // pool.block_size) - len(seq.block_table))
        if needed > pool.num_free_blocks:
            return None
        for seq, end in zip(running, ends, strict=True):
            pool.append_slots(seq.block_table, end)
        return [end - seq.num_computed_tokens for seq, end in zip(running, ends, strict=True)]

    def _preempt(self, seq: Sequence) -> None:
        """Returns a running sequence to the front of the waiting queue, freeing its blocks; it
        keeps its tokens and block hashes, and prefills again (mostly from the prefix cache)."""
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a live sequence: out of its queue, its blocks freed."""
        self._queues[seq.status].remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._live[seq.seq_id]
        self.slots.count(seq, -1)
        self.num_constrained -= seq.grammar is not None

    def _free(self, seq: Sequence) -> None:
        """Gives the blocks and the processor slot of `seq` back."""
        self.block_pool.free(seq.block_table, seq.params.extra_args)
        self.slots.release(seq)
        seq.block_table = []

    def check_integrity(self) -> None:
        """Raises `IntegrityError` unless the scheduler's and the pool's invariants hold."""
        check_integrity(self)
