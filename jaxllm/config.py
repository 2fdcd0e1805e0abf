"""The engine's settings: one frozen dataclass, validated at construction (no jax here)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from jaxllm.cache import EvictionPolicy

DEFAULT_CPU_MODEL = "random:qwen3-tiny"
DEFAULT_GPU_MODEL = "random:qwen3-0.6b"


@dataclass(frozen=True)
class EngineConfig:
    """Everything `jaxllm.LLM` accepts besides the model (vLLM / nano-vllm names).

    Attributes:
        model: a Hugging Face Qwen3 directory, an orbax checkpoint saved by jaxllm, a Hub id, or
            "random:<shape>" for a built-in shape with random weights.
        tensor_parallel_size: number of devices the model is sharded over.
        max_num_seqs: the most sequences in one decode step.
        max_num_batched_tokens: the most tokens (tile-padded) in one prefill step.
        max_model_len: the longest sequence, prompt plus output.
        kvcache_block_size: tokens per KV block, a power of two >= 8.
        num_kvcache_blocks: KV capacity in blocks; None sizes it from free device memory.
        memory_fraction: the share of device memory jaxllm may fill (weights, activations, KV).
        dtype: "float32" or "bfloat16"; None: bfloat16 on a GPU, else the checkpoint's dtype.
        enable_prefix_caching: reuse the KV of identical full blocks across requests.
        eviction_policy: "lru", "fifo", "lfu", "mru", or an `EvictionPolicy` instance.
        seed: the seed of random weights and of requests that bring no seed of their own.
        prefill_tile: prefill tokens are laid out in tiles of this many tokens of one sequence;
            None: 128 on a GPU, 16 on a CPU.
        attention_backend: "auto" (the fastest measured: "pallas" on a GPU, else "reference"),
            "reference" (portable jax.numpy), "flash" (FlashAttention-3), "pallas",
            or a registered backend name.
        scan_layers: True runs the decoder layers as one `scan` over stacked weights (compile
            time independent of depth); False, a loop over one weight buffer per layer, which
            avoids XLA:GPU's per-step copies of the weights (qwen3.py; 18% faster decode steps
            on an H200, docs/performance.md) and compiles ~2-4x slower; None: the loop on a
            GPU, else the scan.
        fuse_projections: hold q/k/v and gate/up each as one weight per layer, one matmul each
            without XLA's per-step weight concatenation (layouts.fuse_projections; 1-2% faster
            decode steps on an H200, docs/performance.md); None: fused on a GPU, not on a CPU
            (where the separate weights compile faster and give the same results).
        compile_at_startup: compile every bucket of the ladder before serving, and run each
            executable once (`ModelRunner.warm_up`).
        compilation_cache_dir: JAX's persistent compilation cache; "" turns it off.
    """

    model: str = ""
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
    prefill_tile: int | None = None
    attention_backend: str = "auto"
    scan_layers: bool | None = None
    fuse_projections: bool | None = None
    compile_at_startup: bool = True
    compilation_cache_dir: str = dataclasses.field(
        default_factory=lambda: os.environ.get(
            "JAXLLM_COMPILATION_CACHE", os.path.expanduser("~/.cache/jaxllm/xla")
        )
    )

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if self.tensor_parallel_size not in (1, 2, 4, 8):
            fail("tensor_parallel_size", "1, 2, 4 or 8")
        if self.max_num_seqs < 1:
            fail("max_num_seqs", "an integer >= 1")
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
        tile = self.prefill_tile
        if tile is not None and (tile < 1 or tile & (tile - 1)):
            fail("prefill_tile", "None or a power of two")
        if tile is not None and self.max_num_batched_tokens < tile:
            fail("max_num_batched_tokens", f"at least prefill_tile={tile}")
