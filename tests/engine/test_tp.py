"""Tensor parallelism through the whole engine, on emulated CPU devices: greedy tokens at TP=2,
TP=4 and TP=8 equal TP=1's and transformers', with chunked prefill and prefix caching at work;
and the same across two processes joined by `jax.distributed` (multi-controller, gloo
collectives).

Run as a script (`python tests/engine/test_tp.py --worker ...`) this file is one process of the
two-process test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# 8 query heads, 4 kv heads, head dim 64, 2 layers, hidden 128 (ffn 288), an untied LM head.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS, VOCAB = 8, 4, 64, 128, 2, 256
# The same with 16 query heads, 8 kv heads, head dim 32: kv heads are sharded, so TP=8 needs 8.
TP8_HEADS, TP8_KV_HEADS, TP8_HEAD_DIM = 16, 8, 32
NUM_TOKENS = 10
SETTINGS = dict(
    kvcache_block_size=16,
    max_num_batched_tokens=32,  # two prefill tiles of 16: prompts of 45+ tokens are chunked
    max_num_seqs=4,
    max_model_len=128,
    num_kvcache_blocks=32,
    dtype="float32",
    enable_prefix_caching=True,
    compile_at_startup=False,
    compilation_cache_dir="",
)


def make_prompts() -> list[list[int]]:
    """Three prompts sharing a 40-token prefix (two full blocks), and one unrelated prompt."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, 40).tolist()
    shared = [prefix + rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 30)]
    return [*shared, rng.integers(0, VOCAB, 9).tolist()]


def generate(llm) -> list[list[int]]:
    from jaxllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate(make_prompts(), greedy, use_tqdm=False)]


def save_checkpoint(
    tmp_path_factory, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[Path, list[list[int]]]:
    """A transformers Qwen3 saved to disk, and its greedy tokens for `make_prompts()`."""
    import torch
    from hf_reference import random_qwen3

    model = random_qwen3(
        vocab_size=VOCAB,
        hidden=HIDDEN,
        layers=LAYERS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tied=False,
        max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tp-engine")
    model.save_pretrained(path)
    reference = []
    with torch.no_grad():
        for prompt in make_prompts():
            tokens = list(prompt)
            for _ in range(NUM_TOKENS):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
            reference.append(tokens[len(prompt) :])
    return path, reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    return save_checkpoint(tmp_path_factory, HEADS, KV_HEADS, HEAD_DIM)


@pytest.fixture(scope="module")
def checkpoint_tp8(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    return save_checkpoint(tmp_path_factory, TP8_HEADS, TP8_KV_HEADS, TP8_HEAD_DIM)


def check_greedy_tokens_and_shards(
    checkpoint,
    tp: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    attention_backend: str = "auto",
    scan_layers: bool = True,
    fuse_projections: bool = False,
) -> None:
    """Greedy tokens at `tp` equal transformers', the prefix cache hit, and the weights and the
    KV cache are split `tp` ways (weights stacked over layers, or one tree per layer; q/k/v and
    gate/up apart or fused)."""
    from jaxllm import LLM

    path, reference = checkpoint
    llm = LLM(
        str(path),
        tensor_parallel_size=tp,
        attention_backend=attention_backend,
        scan_layers=scan_layers,
        fuse_projections=fuse_projections,
        **SETTINGS,
    )

    assert generate(llm) == reference
    stats = llm.cache_stats()
    assert stats.num_hit_tokens >= 2 * 32  # the later shared-prefix prompts hit two blocks
    assert llm.engine.scheduler_config.max_num_batched_tokens == 32  # prompts were chunked
    params = llm.engine.runner.params
    if scan_layers:
        layers, stacked = params["layers"], (LAYERS,)
    else:
        assert {name for name in params if name.startswith("layers")} == {
            f"layers_{i}" for i in range(LAYERS)
        }
        layers, stacked = params[f"layers_{LAYERS - 1}"], ()
    if fuse_projections:  # for each kv head: its query heads, its key, its value
        qkv_proj = layers["attn"]["qkv_proj"]
        assert len(qkv_proj.addressable_shards) == tp
        group = num_heads // num_kv_heads
        shape = (*stacked, HIDDEN, num_kv_heads // tp, group + 2, head_dim)
        assert qkv_proj.addressable_shards[0].data.shape == shape
        gate_up_proj = layers["mlp"]["gate_up_proj"]
        shape = (*stacked, HIDDEN, 2, (2 * HIDDEN + 32) // tp)
        assert gate_up_proj.addressable_shards[0].data.shape == shape
    else:
        q_proj = layers["attn"]["q_proj"]
        assert len(q_proj.addressable_shards) == tp
        shape = (*stacked, HIDDEN, num_heads // tp, head_dim)
        assert q_proj.addressable_shards[0].data.shape == shape
    down_proj = layers["mlp"]["down_proj"]
    assert down_proj.addressable_shards[0].data.shape == (*stacked, (2 * HIDDEN + 32) // tp, HIDDEN)
    assert params["embed"].addressable_shards[0].data.shape == (VOCAB // tp, HIDDEN)
    assert params["lm_head"].addressable_shards[0].data.shape == (HIDDEN, VOCAB // tp)
    keys = llm.engine.runner.kv_cache.keys
    assert len(keys.addressable_shards) == tp
    assert keys.addressable_shards[0].data.shape == (LAYERS, 32, 16, num_kv_heads // tp, head_dim)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_tokens_equal_transformers_at_every_tp(checkpoint, tp):
    check_greedy_tokens_and_shards(checkpoint, tp, HEADS, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_equal_transformers_with_a_buffer_per_layer(checkpoint, tp):
    """The GPU's layer loop (`scan_layers=False`: one weight buffer per layer, no scan)."""
    check_greedy_tokens_and_shards(checkpoint, tp, HEADS, KV_HEADS, HEAD_DIM, scan_layers=False)


@pytest.mark.parametrize(("tp", "scan_layers"), [(1, True), (2, False)])
def test_greedy_tokens_equal_transformers_with_fused_projections(checkpoint, tp, scan_layers):
    """q/k/v and gate/up each as one weight (`fuse_projections`), with either layer layout."""
    check_greedy_tokens_and_shards(
        checkpoint, tp, HEADS, KV_HEADS, HEAD_DIM, scan_layers=scan_layers, fuse_projections=True
    )


def test_greedy_tokens_equal_transformers_at_tp8(checkpoint_tp8):
    """TP=8 (one kv head and two query heads per device) on 8 emulated devices."""
    check_greedy_tokens_and_shards(checkpoint_tp8, 8, TP8_HEADS, TP8_KV_HEADS, TP8_HEAD_DIM)


@pytest.mark.parametrize("fuse_projections", [False, True], ids=["apart", "fused"])
def test_pallas_decode_kernel_under_the_mesh(checkpoint, fuse_projections):
    """The "pallas" backend at TP=2: its kernels (interpreted on a CPU; with fused q/k/v, the
    q/k norm, rotary and cache-write kernel too) under shard_map, the step lowered for the GSPMD
    partitioner as on a GPU (`sharding.partitioner_for`)."""
    check_greedy_tokens_and_shards(
        checkpoint, 2, HEADS, KV_HEADS, HEAD_DIM, "pallas", fuse_projections=fuse_projections
    )


def test_tp_that_does_not_divide_the_heads_is_refused_at_construction():
    from jaxllm import LLM

    # qwen3-tiny: 4 query heads, 2 kv heads.
    with pytest.raises(ValueError, match=r"num_heads \(4\) and num_kv_heads \(2\)"):
        LLM("random:qwen3-tiny", tensor_parallel_size=4, **SETTINGS)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_two_processes_share_one_mesh(checkpoint, tmp_path):
    """jax.distributed over two CPU processes of two devices each: one TP=4 mesh."""
    import jax

    if "jax_cpu_collectives_implementation" not in jax.config.values:
        pytest.skip("this jax has no CPU collectives across processes (gloo)")
    path, reference = checkpoint
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["JAX_PLATFORMS"] = "cpu"
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), str(port), str(path), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for worker in workers:
        try:
            logs.append(worker.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            pytest.fail("the two-process run timed out")
    for worker, log in zip(workers, logs, strict=True):
        assert worker.returncode == 0, log[-4000:]
    for i in range(2):
        result = json.loads((tmp_path / f"process{i}.json").read_text())
        assert result["devices"] == 4 and result["local_devices"] == 2
        assert result["q_proj_shards"] == [[LAYERS, HIDDEN, HEADS // 4, HEAD_DIM]] * 2
        assert result["token_ids"] == reference


def _worker(process_id: int, port: int, model: str, out: str) -> None:
    """One process of `test_two_processes_share_one_mesh`."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id
    )
    from jaxllm import LLM

    llm = LLM(model, tensor_parallel_size=4, **SETTINGS)
    token_ids = generate(llm)
    q_proj = llm.engine.runner.params["layers"]["attn"]["q_proj"]
    result = {
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "q_proj_shards": [list(shard.data.shape) for shard in q_proj.addressable_shards],
        "token_ids": token_ids,
    }
    (Path(out) / f"process{process_id}.json").write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=4, metavar=("PROCESS_ID", "PORT", "MODEL", "OUT"))
    args = parser.parse_args()
    process_id, port, model, out = args.worker
    _worker(int(process_id), int(port), model, out)
