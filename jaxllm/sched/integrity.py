"""The scheduler's invariants, checked by tests and soak runs (`Scheduler.check_integrity`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxllm.cache.block_pool import require
from jaxllm.sched.sequence import SequenceStatus

if TYPE_CHECKING:
    from jaxllm.sched.scheduler import Scheduler


def check_integrity(scheduler: Scheduler) -> None:
    """Raises `IntegrityError` unless the scheduler's and its block pool's invariants hold."""
    cfg, pool = scheduler.config, scheduler.block_pool
    pool.check_integrity(seq.block_table for seq in scheduler.running)
    queues = (scheduler.running, scheduler.waiting, scheduler.sampling_last)
    ids = [seq.seq_id for queue in queues for seq in queue]
    require(len(ids) == len(set(ids)), "a sequence is queued twice")
    require(set(ids) == set(scheduler._live), "the live set differs from the queues")
    require(len(scheduler.running) <= cfg.max_num_seqs, "more running sequences than max_num_seqs")
    for seq in scheduler.waiting:
        require(seq.status is SequenceStatus.WAITING, f"{seq} in the waiting queue")
        require(not seq.block_table and seq.num_computed_tokens == 0, f"{seq} holds blocks")
    for seq in scheduler.sampling_last:
        require(seq.status is SequenceStatus.SAMPLING_LAST, f"{seq} sampling its last token")
        require(not seq.block_table, f"{seq} holds blocks")
    size = cfg.block_size
    for seq in scheduler.running:
        require(seq.status is SequenceStatus.RUNNING, f"{seq} in the running list")
        num_full = seq.num_computed_tokens // size  # blocks written in full
        # NOTE: a planned step may compute the token the step before is still sampling.
        longest = max(seq.num_tokens, seq.num_computed_tokens)
        require(
            -(-seq.num_computed_tokens // size) <= len(seq.block_table) <= -(-longest // size),
            f"{seq}: block table does not match its tokens",
        )
        require(
            seq.num_computed_tokens <= seq.num_tokens + scheduler.ladder.num_steps,
            f"{seq}: computes tokens that were never sampled",
        )
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
    # The logits processors' slots: each running sequence that asks holds one of its own.
    held = [seq.processors.slot for seq in scheduler.running if seq.processors is not None]
    free = scheduler.slots.free
    require(None not in held, "a running sequence with logits processors holds no slot")
    require(
        sorted(held + free) == list(range(cfg.max_num_seqs)),
        "the processor slots held and free are not each slot once",
    )
