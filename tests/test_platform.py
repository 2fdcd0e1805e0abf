"""What the platform module decides for each kind of machine, without one of them: the
attention kernels, the param dtype, the prefill tile, the embedded default."""

from __future__ import annotations

import jax
import pytest

from jaxllm.model.attention import LOOP_COMMAND_BUFFERS, Kernels
from jaxllm.model.decode_attention import tile_rows
from jaxllm.platform import ATTENTION_ENV, CUBLAS_FROM_ROWS, GPU_DECODE_ROWS, Platform

CPU = Platform("cpu", "cpu")
H200 = Platform("gpu", "NVIDIA H200", nvidia=True, flash_attention=True)
H200_WITHOUT_FA3 = Platform("gpu", "NVIDIA H200", nvidia=True)
ROCM = Platform("gpu", "AMD Instinct MI300X")
# What every NVIDIA GPU's kernels carry.
NVIDIA = {
    "cublas_from_rows": CUBLAS_FROM_ROWS,
    "decode_rows": GPU_DECODE_ROWS,
    "fixed_inputs": True,
    "mailbox": "device",
}
ON_CPU = {"interpret": True, "fused_argmax": False}  # what a CPU's kernels carry


def test_kernel_tiles():
    assert tile_rows(256, 8) == 64  # 8 tokens x 8 kv heads
    assert tile_rows(16, 1) == 16
    assert tile_rows(8, 1) is None  # 8 rows: below the kernel's smallest tile
    assert tile_rows(256, 3) is None  # 64 rows are not a multiple of 3 kv heads


@pytest.mark.parametrize(
    ("platform", "block_size", "kv_heads", "expected"),
    [
        (CPU, 256, 8, Kernels("reference", "reference", **ON_CPU)),
        (ROCM, 256, 8, Kernels("reference", "reference", interpret=True)),
        (H200_WITHOUT_FA3, 256, 8, Kernels("reference", "pallas", **NVIDIA)),
        (H200, 256, 8, Kernels("flash", "pallas", **NVIDIA)),
        (H200, 256, 1, Kernels("flash", "pallas", **NVIDIA)),  # 64 tokens x 1 kv head
        (
            H200,
            8,
            1,
            Kernels("flash", "flash", **NVIDIA),
        ),  # 8 tokens x 1 kv head: no tile for the kernel
        (H200_WITHOUT_FA3, 8, 1, Kernels("reference", "reference", **NVIDIA)),
    ],
)
def test_auto_picks_the_pallas_kernel_on_nvidia_gpus_where_it_has_a_tile(
    platform, block_size, kv_heads, expected
):
    assert platform.kernels(block_size, kv_heads) == expected


def test_a_named_backend_is_kept_and_runs_interpreted_off_a_gpu_or_refused():
    assert CPU.replace(attention_backend="pallas").kernels(256, 8) == Kernels(
        "reference", "pallas", **ON_CPU
    )
    assert H200.replace(attention_backend="reference").kernels(256, 8) == Kernels(**NVIDIA)
    assert H200.replace(attention_backend="flash").kernels(256, 8) == Kernels(
        "flash", "flash", **NVIDIA
    )
    for platform in (H200_WITHOUT_FA3, CPU):  # refused at start-up, not at the first step
        with pytest.raises(ValueError, match=r"=flash needs FlashAttention-3.*flash-attn3-jax"):
            platform.replace(attention_backend="flash").kernels(256, 8)
    with pytest.raises(ValueError, match="=pallas: the decode kernel has no tile for blocks of 8"):
        CPU.replace(attention_backend="pallas").kernels(8, 1)


def test_cublas_takes_the_matmuls_of_large_steps_on_nvidia_gpus_only():
    kernels = H200.kernels(256, 8)
    unchecked_autotuning = {"xla_gpu_autotune_level": 1}
    assert kernels.compiler_options(CUBLAS_FROM_ROWS) == unchecked_autotuning | {
        "xla_gpu_enable_triton_gemm": False
    }
    # XLA's own GEMMs and GEMVs
    assert kernels.compiler_options(CUBLAS_FROM_ROWS - 1) == unchecked_autotuning
    for platform in (CPU, ROCM):
        assert platform.kernels(256, 8).compiler_options(1 << 14) == {}


def test_multi_step_programs_on_nvidia_gpus_run_their_loop_in_one_cuda_graph():
    loop = H200.kernels(256, 8).compiler_options(8, loop=True)
    assert loop == H200.kernels(256, 8).compiler_options(8) | {
        "xla_gpu_enable_command_buffer": LOOP_COMMAND_BUFFERS
    }
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUSTOM_CALL"} <= set(LOOP_COMMAND_BUFFERS.split(","))
    # XLA knows every kind named (an unknown one is refused at compile time, on any backend)
    jax.jit(lambda x: x + 1).lower(1.0).compile(loop)
    assert CPU.kernels(256, 8).compiler_options(8, loop=True) == {}


def test_the_environment_names_the_backend(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "pallas")
    assert Platform.detect().attention_backend == "pallas"
    monkeypatch.setenv(ATTENTION_ENV, "flash3")
    with pytest.raises(ValueError, match=r"JAXLLM_ATTENTION_BACKEND must be one of .*pallas"):
        Platform.detect()


def test_gpu_and_cpu_defaults():
    assert (H200.dtype, H200.prefill_tile) == ("bfloat16", 128)
    assert (CPU.dtype, CPU.prefill_tile) == (None, 16)  # None: the checkpoint's own dtype
    assert H200.default_model == "random:qwen3-0.6b" and H200.default_engine_kwargs == {}
    assert CPU.default_model == "random:qwen3-tiny"
    assert CPU.default_engine_kwargs["max_num_seqs"] == 16


def test_settings_left_to_the_model_and_the_platform():
    from jaxllm.config import EngineConfig
    from jaxllm.model.config import PRESETS
    from jaxllm.startup import resolve_defaults

    model = PRESETS["qwen3-tiny"]
    on_cpu, on_gpu = (resolve_defaults(EngineConfig(), model, p) for p in (CPU, H200))
    assert (on_cpu.compile_at_startup, on_gpu.compile_at_startup) == (False, True)
    assert on_cpu.max_model_len == 4096  # below the model's 40,960
    short = model.replace(max_position_embeddings=512)
    assert resolve_defaults(EngineConfig(), short, CPU).max_model_len == 512
    assert resolve_defaults(EngineConfig(compile_at_startup=True), model, CPU).compile_at_startup
    with pytest.raises(ValueError, match=r"max_model_len=1024 is more than .* \(512\)"):
        resolve_defaults(EngineConfig(max_model_len=1024), short, CPU)
