"""The engine's settings: one frozen dataclass, validated at construction (no jax here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxllm.cache import EvictionPolicy
from jaxllm.cache.eviction import POLICIES
from jaxllm.fields import FLAG, Check, as_bool, as_int, as_real, as_str, check_fields


@dataclass(frozen=True)
class EngineConfig:
    """Everything `jaxllm.LLM` accepts besides the model (vLLM and nano-vllm names).

    What follows from the hardware (kernels, the prefill tile, the param dtype by default) is
    decided by `jaxllm.platform`, not here.

    Attributes:
        tensor_parallel_size: number of devices the model is sharded over.
        max_num_seqs: the most sequences in one decode step.
        max_num_batched_tokens: the most tokens in one prefill step, rounded down to a
            multiple of the platform's prefill tile (16 on a CPU, 128 on a GPU), at least one.
        max_model_len: the longest sequence, prompt plus output; None: the model's
            max_position_embeddings, at most 4,096. More than the model's is refused.
        kvcache_block_size: tokens per KV block, a power of two >= 8.
        num_kvcache_blocks: KV capacity in blocks; None sizes it from free device memory.
        gpu_memory_utilization: the share of device memory jaxllm may fill (weights,
            activations, KV); `LLM` also takes it as memory_fraction.
        dtype: "float32" or "bfloat16"; None: bfloat16 on a GPU, else the checkpoint's dtype.
        enable_prefix_caching: reuse the KV of identical full blocks across requests.
        eviction_policy: "lru", "fifo", "lfu", "mru", or an `EvictionPolicy` instance.
        seed: the seed of random weights and of requests that bring no seed of their own.
        compile_at_startup: compile every bucket of the ladder before serving, and run each
            executable once; False compiles each bucket when a step first needs it. None: True
            on a GPU, False on a CPU.
        num_scheduler_steps: decode steps run on the device per plan, sampling included, when
            no request waits and at most 32 run (vLLM's multi-step scheduling); None: 8 on a
            GPU, 1 on a CPU.
        max_logprobs: the most `SamplingParams.logprobs` a request may ask for (the top tokens
            every step with logprobs computes).
        logprobs_mode: "raw_logprobs": generated tokens' logprobs from the model's logits
            (a structured output's mask applied, as vLLM's); "processed_logprobs": from the
            logits each row samples from, after penalties, bias, temperature, min-p, top-k and
            top-p (removed tokens at -inf). Prompt logprobs are raw either way.

    Integers may be Python or numpy integers, numbers numpy floats too (stored as Python
    values); booleans are not numbers, and flags must be booleans.

    Raises:
        ValueError: a value of the wrong type or outside its range, naming the field.
    """

    tensor_parallel_size: int = 1
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None
    kvcache_block_size: int = 256
    num_kvcache_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str | None = None
    enable_prefix_caching: bool = True
    eviction_policy: str | EvictionPolicy = "lru"
    seed: int = 0
    compile_at_startup: bool | None = None
    num_scheduler_steps: int | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        check_fields(self, _CHECKS)

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`LLM`'s engine arguments, checked as fields; memory_fraction is
        gpu_memory_utilization.

        Raises:
            TypeError: an unknown name, or both names of gpu_memory_utilization.
            ValueError: as construction does; a policy instance another pool uses.
        """
        kwargs = dict(kwargs)
        if "memory_fraction" in kwargs:
            if "gpu_memory_utilization" in kwargs:
                raise TypeError("pass gpu_memory_utilization or memory_fraction, not both")
            kwargs["gpu_memory_utilization"] = kwargs.pop("memory_fraction")
        unknown = sorted(set(kwargs) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {', '.join(unknown)}")
        cls(**kwargs)
        policy = kwargs.get("eviction_policy")
        if isinstance(policy, EvictionPolicy) and policy.pool is not None:
            raise ValueError(
                f"eviction_policy: this {type(policy).__name__} instance already serves another "
                "LLM's pool; give each LLM its own instance, or the policy's name"
            )
        return kwargs


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# NOTE: sizes and positions travel to the device as int32.
_INT32_LIMIT = 2**31


def _in_range(low: int, high: int = _INT32_LIMIT) -> Callable[[int], bool]:
    return lambda value: low <= value < high


def _is_policy(policy: object) -> bool:
    return isinstance(policy, EvictionPolicy) or (
        isinstance(policy, str) and policy.lower() in POLICIES
    )


# What each field allows (see `check_fields`).
_CHECKS: dict[str, Check] = {
    "tensor_parallel_size": (as_int, lambda n: n in (1, 2, 4, 8), "1, 2, 4 or 8"),
    "max_num_seqs": (as_int, _in_range(1), "an integer in [1, 2**31)"),
    "max_num_batched_tokens": (as_int, _in_range(1), "an integer in [1, 2**31)"),
    "max_model_len": (as_int, _in_range(2), "None or an integer in [2, 2**31)"),
    "kvcache_block_size": (
        as_int,
        lambda n: 8 <= n < _INT32_LIMIT and not n & (n - 1),
        "a power of two >= 8",
    ),
    "num_kvcache_blocks": (as_int, _in_range(1), "None or an integer in [1, 2**31)"),
    "gpu_memory_utilization": (as_real, lambda f: 0.0 < f <= 1.0, "a number in (0, 1]"),
    "dtype": (
        as_str,
        lambda dtype: dtype in ("float32", "bfloat16"),
        'None, "float32" or "bfloat16"',
    ),
    "enable_prefix_caching": FLAG,
    "eviction_policy": (
        lambda policy: policy if _is_policy(policy) else None,
        None,
        f"one of {sorted(POLICIES)} or an EvictionPolicy instance",
    ),
    # NOTE: the random weights' key takes an int64.
    "seed": (as_int, _in_range(0, 2**63), "an integer in [0, 2**63)"),
    "compile_at_startup": (as_bool, None, "None, True or False"),
    "num_scheduler_steps": (as_int, lambda n: 1 <= n <= 64, "None or an integer in [1, 64]"),
    "max_logprobs": (as_int, _in_range(1, 1025), "an integer in [1, 1024]"),
    "logprobs_mode": (as_str, LOGPROBS_MODES.__contains__, f"one of {', '.join(LOGPROBS_MODES)}"),
}
