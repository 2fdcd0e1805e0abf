"""Attention over the paged KV cache: the kernels a step can use, and the portable reference.

Every attention function is `fn(q, k_cache, v_cache, inputs) -> out` with
    q: [T, N, H] the step's queries (rotary embedding applied),
    k_cache, v_cache: [NB, BS, K, H] a block pool (`KVCache.layer_views`) that `inputs`' block
        tables address, the step's own keys and values already written,
    inputs: the step's `ModelInputs` (tiles, block tables, context lengths),
    out: [T, N, H] in q's dtype.
Rows of a tile attend with a bottom-right causal mask: row i of tile g sits at position
`context_lens[g] - tile_size + i` and sees the keys at positions up to its own.

Legend: T tokens, G tiles, R rows per tile (tile_size), W block-table width, NB blocks,
BS block size, P context positions (W * BS), N query heads, K kv heads, Q query heads per kv
head (N // K), H head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.model import decode_attention, flash_attention
from jaxllm.model.inputs import ModelInputs

PREFILL_KERNELS = ("reference", "flash")
DECODE_KERNELS = ("reference", "flash", "pallas")
# XLA's default kinds of CUDA-graph commands, and loops: a multi-step program's loop runs in its
# graph (a conditional node), one launch a plan, where XLA launched the body's graph from the
# host every step (0.7 - 1.1 ms of the host's a step at one row; docs/performance.md).
LOOP_COMMAND_BUFFERS = ",".join([
    *("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION"),
    *("WHILE", "CONDITIONAL"),
])  # fmt: skip


@dataclass(frozen=True)
class Kernels:
    """The kernels of prefill and of decode steps (tiles of one token), decided by
    `jaxllm.platform` (hashable: a static jit argument of the model).

    Attributes:
        prefill: "reference" (portable jax.numpy) or "flash" (FlashAttention-3, Hopper).
        decode: "reference", "flash", or "pallas": jaxllm's Pallas (Triton) paged-decode kernel,
            and the q/k norms, rotary embedding and cache write as one more (`qkv_kernel.py`).
        interpret: run the Pallas kernels in Pallas' interpreter (off a GPU, in tests).
        cublas_from_rows: steps of this many rows or more run their matmuls on cuBLAS, not on
            XLA's Triton GEMMs (`compiler_options`); None: XLA's choice everywhere.
        fused_argmax: the sampler draws in one argmax over the noisy logits
            (`sampler.noisy_argmax`).
        decode_programs: the programs the Pallas decode kernel shares a step's keys out over,
            fewer for the balanced kernel (`decode_attention.num_programs_for`).
        decode_rows: a decode step of fewer rows runs its layers on this many, the rest
            padding (`qwen3.padded_decode`).
        fixed_inputs: a one-step plan's forward pass and sampler read their inputs from buffers
            that keep their device addresses (`steps.FixedInputs`), so XLA launches their CUDA
            graphs without updating them.
        mailbox: constrained rows' plans of several decode steps take each step's token mask
            from the host while they run (`jaxllm.handoff`, one device): "device" (NVIDIA
            GPUs) or "host" (callbacks: a CPU, in tests); None: such rows take plans of one step.
    """

    prefill: str = "reference"
    decode: str = "reference"
    interpret: bool = False
    cublas_from_rows: int | None = None
    fused_argmax: bool = True
    decode_programs: int = decode_attention.DEFAULT_PROGRAMS
    decode_rows: int = 1
    fixed_inputs: bool = False
    mailbox: str | None = None

    def __post_init__(self) -> None:
        for kind, names in (("prefill", PREFILL_KERNELS), ("decode", DECODE_KERNELS)):
            if (name := getattr(self, kind)) not in names:
                raise ValueError(f"{kind} kernel must be one of {names}, not {name!r}")

    def compiler_options(self, num_rows: int, loop: bool = False) -> dict[str, bool | int | str]:
        """XLA options of a program of `num_rows` rows (tokens); `loop`: a multi-step program."""
        if self.cublas_from_rows is None:
            return {}
        # NOTE: XLA's autotuning without its correctness checks (level 1 of 4): programs as
        # fast, compiled in less time (docs/performance.md).
        options: dict[str, bool | int | str] = {"xla_gpu_autotune_level": 1}
        if num_rows >= self.cublas_from_rows:
            options["xla_gpu_enable_triton_gemm"] = False
        if loop:
            options["xla_gpu_enable_command_buffer"] = LOOP_COMMAND_BUFFERS
        return options

    @property
    def custom_calls(self) -> bool:
        """Whether a step calls kernels outside XLA (FlashAttention-3, Pallas)."""
        return (self.prefill, self.decode) != ("reference", "reference")


PORTABLE = Kernels()  # jax.numpy attention for every step


def attend(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: ModelInputs, kernels: Kernels
) -> jax.Array:
    """Attention of the step's queries with the kernel `kernels` names for this kind of step."""
    kernel = kernels.decode if inputs.tile_size == 1 else kernels.prefill
    if kernel == "flash":
        return flash_attention.flash_attention(q, k_cache, v_cache, inputs)
    if kernel == "pallas":
        return decode_attention.paged_decode_attention(
            q, k_cache, v_cache, inputs.block_tables, inputs.context_lens,
            num_programs=kernels.decode_programs, interpret=kernels.interpret,
        )  # fmt: skip
    return reference_attention(q, k_cache, v_cache, inputs)


def reference_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, inputs: ModelInputs
) -> jax.Array:
    """Portable jax.numpy attention: gathers each tile's context through its block table
    (O(G * P * K * H) memory: for tests, CPUs and modest batches)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_tiles, width = inputs.block_tables.shape
    tile_size = num_tokens // num_tiles
    group = num_heads // num_kv_heads
    context = width * block_size

    q = q.reshape(num_tiles, tile_size, num_kv_heads, group, head_dim)  # [G, R, K, Q, H]
    k = k_cache[inputs.block_tables].reshape(num_tiles, context, num_kv_heads, head_dim)
    v = v_cache[inputs.block_tables].reshape(num_tiles, context, num_kv_heads, head_dim)

    scores = jnp.einsum("GRKQH,GPKH->GKQRP", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim**-0.5)
    query_positions = inputs.context_lens[:, None] - tile_size + jnp.arange(tile_size)  # [G, R]
    key_positions = jnp.arange(context)  # [P]
    visible = (key_positions <= query_positions[:, :, None])[:, None, None]  # [G, 1, 1, R, P]
    # NOTE: a finite fill keeps rows with no visible key (front padding) free of NaN; they are
    # zeroed below.
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("GKQRP,GPKH->GRKQH", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
