"""The engine's settings: one frozen dataclass, validated at construction (no jax here)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.cache import EvictionPolicy


@dataclass(frozen=True)
class EngineConfig:
    """Everything `jaxllm.LLM` accepts besides the model (vLLM and nano-vllm names).

    What follows from the hardware (kernels, the prefill tile, the param dtype by default) is
    decided by `jaxllm.platform`, not here.

    Attributes:
        tensor_parallel_size: number of devices the model is sharded over.
        max_num_seqs: the most sequences in one decode step.
        max_num_batched_tokens: the most tokens (tile-padded) in one prefill step.
        max_model_len: the longest sequence, prompt plus output.
        kvcache_block_size: tokens per KV block, a power of two >= 8.
        num_kvcache_blocks: KV capacity in blocks; None sizes it from free device memory.
        memory_fraction: the share of device memory jaxllm may fill (weights, activations, KV);
            `LLM` also takes vLLM's name for it, gpu_memory_utilization.
        dtype: "float32" or "bfloat16"; None: bfloat16 on a GPU, else the checkpoint's dtype.
        enable_prefix_caching: reuse the KV of identical full blocks across requests.
        eviction_policy: "lru", "fifo", "lfu", "mru", or an `EvictionPolicy` instance.
        seed: the seed of random weights and of requests that bring no seed of their own.
        compile_at_startup: compile every bucket of the ladder before serving, and run each
            executable once; False compiles each bucket when a step first needs it.
    """

    tensor_parallel_size: int = 1
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None
    memory_fraction: float = 0.9
    dtype: str | None = None
    enable_prefix_caching: bool = True
    eviction_policy: str | EvictionPolicy = "lru"
    seed: int = 0
    compile_at_startup: bool = True

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if self.tensor_parallel_size not in (1, 2, 4, 8):
            fail("tensor_parallel_size", "1, 2, 4 or 8")
        if self.max_num_seqs < 1:
            fail("max_num_seqs", "an integer >= 1")
        if self.max_num_batched_tokens < 1:
            fail("max_num_batched_tokens", "an integer >= 1")
        if self.max_model_len < 2:
            fail("max_model_len", "an integer >= 2")
        block = self.kvcache_block_size
        if block < 8 or block & (block - 1):
            fail("kvcache_block_size", "a power of two >= 8")
        if self.num_kvcache_blocks is not None and self.num_kvcache_blocks < 1:
            fail("num_kvcache_blocks", "None or an integer >= 1")
        if not 0.0 < self.memory_fraction <= 1.0:
            fail("memory_fraction", "a number in (0, 1]")
        if self.dtype not in (None, "float32", "bfloat16"):
            fail("dtype", 'None, "float32" or "bfloat16"')
