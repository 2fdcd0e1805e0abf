"""Host-side KV-cache bookkeeping (pure Python + numpy, no jax): prefix hashing, the block pool
and its pluggable eviction policies."""

from jaxllm.cache.block_pool import BlockPool, CacheStats, IntegrityError
from jaxllm.cache.eviction import (
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    PriorityPolicy,
    make_policy,
)
from jaxllm.cache.hashing import extend_block_hashes, hash_block

__all__ = [
    "BlockPool",
    "CacheStats",
    "EvictionPolicy",
    "FIFOPolicy",
    "IntegrityError",
    "LFUPolicy",
    "LRUPolicy",
    "MRUPolicy",
    "PriorityPolicy",
    "extend_block_hashes",
    "hash_block",
    "make_policy",
]
