"""Eviction policies that use what the pool knows of a block (`EvictionPolicy.info`): the
request's metadata and length, the clock, hits and the block's place in its prefix, and that
decide what to keep at all (`EvictionPolicy.admit`). Pass an instance: `LLM(..., eviction_policy=
PrefixCostPolicy())`, or `cache_sim.simulate(..., policy=SessionPolicy())`.
"""

from __future__ import annotations

from jaxllm.cache.eviction import PriorityPolicy


class PrefixCostPolicy(PriorityPolicy):
    """Least recently freed, with blocks of longer requests kept longer: recomputing a prefix
    costs more the longer it is (attention over every token before), so a block counts as
    freed `seconds_per_block` later for each block of the request that held it (Marconi's
    FLOP-aware weighting, in its simplest form). A request's blocks share one weight, so its
    tail is still evicted before its head, which the tail's lookups need.
    """

    name = "prefix-cost"

    def __init__(self, seconds_per_block: float = 1.0) -> None:
        super().__init__()
        self.seconds_per_block = seconds_per_block

    def priority(self, block_id: int) -> float:
        info = self.info(block_id)
        return info.time + self.seconds_per_block * info.holder_blocks


class SessionPolicy(PriorityPolicy):
    """For multi-turn traffic: keeps only blocks of requests that name a session (their
    conversation comes back), and evicts those of lower `priority` first (least recently freed
    among equals). Reads `extra_args={"session_id": ..., "priority": int}` (priority 0 if
    absent).
    """

    name = "session"

    def admit(self, block_id: int) -> bool:
        return self.info(block_id).metadata.get("session_id") is not None

    def priority(self, block_id: int) -> int:
        return self.info(block_id).metadata.get("priority", 0)
