"""What the engine picks for "auto" settings (`Engine._attention_backend`, `_scan_layers`,
`_fuse_projections`), without a GPU."""

from __future__ import annotations

import pytest

from jaxllm import engine
from jaxllm.config import EngineConfig
from jaxllm.model.config import PRESETS
from jaxllm.model.decode_attention import tile_rows

QWEN3_8B = PRESETS["qwen3-8b"]  # 8 kv heads


def test_kernel_tiles():
    assert tile_rows(256, 8) == 64  # 8 tokens x 8 kv heads
    assert tile_rows(16, 1) == 16
    assert tile_rows(8, 1) is None  # 8 rows: below the kernel's smallest tile
    assert tile_rows(256, 3) is None  # 64 rows are not a multiple of 3 kv heads


@pytest.mark.parametrize(
    ("cuda", "fa3", "block_size", "tp", "expected"),
    [
        (False, False, 256, 1, "reference"),  # a CPU, or a ROCm GPU
        (False, True, 256, 1, "reference"),
        (True, False, 256, 1, "pallas"),
        (True, True, 256, 8, "pallas"),  # one kv head per device: 64 tokens x 1 head
        (True, True, 8, 8, "flash"),  # 8 tokens x 1 kv head: no tile for the kernel
        (True, False, 8, 8, "reference"),
    ],
)
def test_auto_picks_the_pallas_kernel_on_nvidia_gpus_where_it_has_a_tile(
    monkeypatch, cuda, fa3, block_size, tp, expected
):
    monkeypatch.setattr(engine, "is_cuda", lambda: cuda)
    monkeypatch.setattr(engine, "flash_available", lambda: fa3)
    config = EngineConfig(kvcache_block_size=block_size, tensor_parallel_size=tp)
    assert engine.Engine._attention_backend(config, QWEN3_8B) == expected


def test_an_explicit_backend_is_kept(monkeypatch):
    monkeypatch.setattr(engine, "is_cuda", lambda: False)
    config = EngineConfig(attention_backend="pallas")
    assert engine.Engine._attention_backend(config, QWEN3_8B) == "pallas"


@pytest.mark.parametrize(
    ("gpu", "setting", "expected"),
    [
        (False, None, True),  # the scan compiles faster; the CPU has no weight copies to avoid
        (True, None, False),  # the layer loop: no per-step copies of the layer weights
        (True, True, True),
        (False, False, False),
    ],
)
def test_layers_scan_on_the_cpu_and_loop_on_a_gpu_unless_set(monkeypatch, gpu, setting, expected):
    monkeypatch.setattr(engine, "is_gpu", lambda: gpu)
    assert engine.Engine._scan_layers(EngineConfig(scan_layers=setting)) is expected


@pytest.mark.parametrize(
    ("gpu", "setting", "expected"),
    [(False, None, False), (True, None, True), (True, False, False), (False, True, True)],
)
def test_projections_fuse_on_a_gpu_unless_set(monkeypatch, gpu, setting, expected):
    monkeypatch.setattr(engine, "is_gpu", lambda: gpu)
    assert engine.Engine._fuse_projections(EngineConfig(fuse_projections=setting)) is expected
