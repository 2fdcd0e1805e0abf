"""The platform: what jaxllm runs on, asked once, and every choice that follows from it.

`Platform.detect()` reads jax's default backend, the first device and whether FlashAttention-3
runs there, once; everything else reads the `Platform` it is handed (param dtype, prefill tile,
attention kernels, the KV cache budget on a CPU, the embedded default model).

The one override, `JAXLLM_ATTENTION_BACKEND` (as vLLM's `VLLM_ATTENTION_BACKEND`): "reference"
(portable jax.numpy), "flash" (FlashAttention-3) or "pallas" (jaxllm's decode kernel, prefill on
FA3 where it runs); unset or "auto", the fastest measured here (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import jax

from jaxllm.model import decode_attention, flash_attention
from jaxllm.model.attention import Kernels

ATTENTION_ENV = "JAXLLM_ATTENTION_BACKEND"
# Device kinds of the Hopper GPUs, where a device does not report its compute capability.
HOPPER = ("H100", "H200", "H800", "H20")
ATTENTION_BACKENDS = ("auto", "reference", "flash", "pallas")

# NOTE: FA3 works in tiles of 128 query rows, so GPU prefill chunks are laid out in tiles of
# 128; on a CPU tiles of 16 pad short prompts less (the portable attention gathers per tile).
GPU_PREFILL_TILE, CPU_PREFILL_TILE = 128, 16
GPU_DECODE_STEPS = 8
# NOTE: on an H200, steps of 64 rows or more run faster on cuBLAS's GEMMs than on XLA's Triton
# ones and compile in a fraction of the time (no autotuning); steps of fewer rows run faster on
# XLA's own (docs/performance.md).
CUBLAS_FROM_ROWS = 64
# NOTE: decode steps of fewer rows run their layers on 8: there a 0.6B model's matmuls are GEMMs,
# at 1 - 4 rows XLA's slower GEMV fusions (docs/performance.md).
GPU_DECODE_ROWS = 8
# NOTE: on a CPU the KV cache is sized from max_num_seqs and max_model_len, within this budget.
CPU_KV_CACHE_BYTES = 2 << 30
CPU_DEFAULT_MODEL, GPU_DEFAULT_MODEL = "random:qwen3-tiny", "random:qwen3-0.6b"
MODEL_ENV = "JAXLLM_MODEL"
# NOTE: each bucket takes about half a second to compile on a 2-core CPU, where it is compiled
# the first time a step needs it; the embedded default there gets a smaller ladder.
CPU_DEFAULT_ENGINE_KWARGS = dict(max_num_seqs=16, max_model_len=1024, max_num_batched_tokens=1024)


@dataclass(frozen=True)
class Platform:
    """The hardware and the attention override.

    Attributes:
        backend: jax's default backend: "cpu", "gpu" or "tpu".
        device_kind: the first device's kind, e.g. "NVIDIA H200".
        nvidia: an NVIDIA GPU, where Pallas kernels compile for Triton (jax names ROCm GPUs
            "gpu" too).
        flash_attention: FlashAttention-3 runs here: `flash-attn3-jax` is installed and the GPU
            is a Hopper (compute capability 9.x).
        attention_backend: one of `ATTENTION_BACKENDS`.
        multiprocessors: the first device's streaming multiprocessors (0 where it says none).
    """

    backend: str
    device_kind: str = ""
    nvidia: bool = False
    flash_attention: bool = False
    attention_backend: str = "auto"
    multiprocessors: int = 0

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{ATTENTION_ENV} must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )

    @classmethod
    def detect(cls) -> Platform:
        """The platform of jax's default backend, with the environment's attention override."""
        device = jax.devices()[0]
        backend = jax.default_backend()
        version = getattr(device.client, "platform_version", "").lower()
        nvidia = backend == "gpu" and "rocm" not in version
        capability = str(getattr(device, "compute_capability", ""))
        hopper = nvidia and (
            capability.startswith("9") or any(kind in device.device_kind for kind in HOPPER)
        )
        return cls(
            backend=backend,
            device_kind=device.device_kind,
            nvidia=nvidia,
            flash_attention=hopper and flash_attention.installed(),
            attention_backend=os.environ.get(ATTENTION_ENV) or "auto",
            multiprocessors=getattr(device, "core_count", 0) if nvidia else 0,
        )

    def replace(self, **changes: Any) -> Platform:
        return dataclasses.replace(self, **changes)

    @property
    def gpu(self) -> bool:
        return self.backend == "gpu"

    @property
    def dtype(self) -> str | None:
        """The param dtype when none is asked for: bfloat16 on a GPU, else the checkpoint's."""
        return "bfloat16" if self.gpu else None

    @property
    def num_scheduler_steps(self) -> int:
        """Decode steps per plan when few requests run: several on a GPU, where the host's time
        per step exceeds the device's; one on a CPU, where compiling each costs more."""
        return GPU_DECODE_STEPS if self.gpu else 1

    @property
    def prefill_tile(self) -> int:
        return GPU_PREFILL_TILE if self.gpu else CPU_PREFILL_TILE

    def kernels(self, block_size: int, kv_heads_per_device: int) -> Kernels:
        """The attention kernels for this cache layout, and where cuBLAS takes the matmuls.

        "auto": on an NVIDIA GPU jaxllm's Pallas decode kernel (measured fastest end to end on
        an H200) where it has a tile for the layout, else FA3 where it runs, with FA3 prefill
        where it runs; the portable attention elsewhere.

        Raises:
            ValueError: "flash" where FlashAttention-3 does not run, "pallas" for a layout its
                decode kernel has no tile for.
        """
        backend = self.attention_backend
        if backend == "flash" and not self.flash_attention:
            raise ValueError(
                f"{ATTENTION_ENV}=flash needs FlashAttention-3: a Hopper GPU and the "
                'flash-attn3-jax package (pip install "jaxllm[hopper]")'
            )
        if backend == "pallas" and not decode_attention.tile_rows(block_size, kv_heads_per_device):
            raise ValueError(
                f"{ATTENTION_ENV}=pallas: the decode kernel has no tile for blocks of "
                f"{block_size} tokens x {kv_heads_per_device} kv heads per device"
            )
        if backend == "auto":
            pallas = self.nvidia and decode_attention.tile_rows(block_size, kv_heads_per_device)
            backend = "pallas" if pallas else "flash" if self.flash_attention else "reference"
        prefill = backend
        if backend == "pallas":
            prefill = "flash" if self.flash_attention else "reference"
        return Kernels(
            prefill=prefill,
            decode=backend,
            interpret=not self.nvidia,
            cublas_from_rows=CUBLAS_FROM_ROWS if self.nvidia else None,
            fused_argmax=self.backend != "cpu",
            decode_programs=decode_attention.num_programs_for(self.multiprocessors),
            decode_rows=GPU_DECODE_ROWS if self.nvidia else 1,
            fixed_inputs=self.nvidia,
            mailbox="device" if self.nvidia else None,
        )

    @property
    def default_model(self) -> str:
        """The embedded default: random qwen3-0.6b on a GPU, else qwen3-tiny (or `JAXLLM_MODEL`)."""
        return os.environ.get(MODEL_ENV) or (GPU_DEFAULT_MODEL if self.gpu else CPU_DEFAULT_MODEL)

    @property
    def default_engine_kwargs(self) -> dict[str, Any]:
        """Engine settings of the embedded default: `EngineConfig`'s on a GPU, else lighter ones."""
        return {} if self.gpu else dict(CPU_DEFAULT_ENGINE_KWARGS)
