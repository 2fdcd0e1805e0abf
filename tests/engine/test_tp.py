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
    from support.hf import random_qwen3

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
    attention: str | None = None,
    **settings,
) -> None:
    """Greedy tokens at `tp` equal transformers', the prefix cache hit, and the weights and the
    KV cache are split `tp` ways (each layer's fused q/k/v by kv heads, with their queries)."""
    from support.engine import make_llm_with

    path, reference = checkpoint
    llm = make_llm_with(path, attention, tensor_parallel_size=tp, **SETTINGS | settings)

    assert generate(llm) == reference
    stats = llm.cache_stats()
    assert stats.num_hit_tokens >= 2 * 32  # the later shared-prefix prompts hit two blocks
    assert llm.engine.scheduler.config.max_num_batched_tokens == 32  # prompts were chunked
    params = llm.engine.runner.params
    layers = params[f"layers_{LAYERS - 1}"]
    qkv_proj = layers["attn"]["qkv_proj"]  # for each kv head: its query heads, key and value
    assert len(qkv_proj.addressable_shards) == tp
    group = num_heads // num_kv_heads
    shape = (HIDDEN, num_kv_heads // tp, group + 2, head_dim)
    assert qkv_proj.addressable_shards[0].data.shape == shape
    gate_up_proj = layers["mlp"]["gate_up_proj"]
    assert gate_up_proj.addressable_shards[0].data.shape == (HIDDEN, 2, (2 * HIDDEN + 32) // tp)
    down_proj = layers["mlp"]["down_proj"]
    assert down_proj.addressable_shards[0].data.shape == ((2 * HIDDEN + 32) // tp, HIDDEN)
    assert params["embed"].addressable_shards[0].data.shape == (VOCAB // tp, HIDDEN)
    assert params["lm_head"].addressable_shards[0].data.shape == (HIDDEN, VOCAB // tp)
    keys = llm.engine.runner.kv_cache.keys
    assert len(keys.addressable_shards) == tp
    assert keys.addressable_shards[0].data.shape == (LAYERS, 32, 16, num_kv_heads // tp, head_dim)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_greedy_tokens_equal_transformers_at_every_tp(checkpoint, tp):
    check_greedy_tokens_and_shards(checkpoint, tp, HEADS, KV_HEADS, HEAD_DIM)


def test_multi_step_decode_at_tp2(checkpoint):
    """Plans of 4 decode steps, each sampled on the device, at TP=2."""
    check_greedy_tokens_and_shards(checkpoint, 2, HEADS, KV_HEADS, HEAD_DIM, num_scheduler_steps=4)


def test_greedy_tokens_equal_transformers_at_tp8(checkpoint_tp8):
    """TP=8 (one kv head and two query heads per device) on 8 emulated devices."""
    check_greedy_tokens_and_shards(checkpoint_tp8, 8, TP8_HEADS, TP8_KV_HEADS, TP8_HEAD_DIM)


def test_pallas_decode_kernels_under_the_mesh(checkpoint):
    """The "pallas" kernels at TP=2 (interpreted on a CPU: attention, and the q/k norm, rotary
    and cache-write kernel) under shard_map, the step lowered for the GSPMD partitioner as on a
    GPU (`sharding.partitioner_for`)."""
    check_greedy_tokens_and_shards(checkpoint, 2, HEADS, KV_HEADS, HEAD_DIM, "pallas")


def test_gpu_step_settings_under_the_mesh(checkpoint):
    """The "pallas" kernels at TP=2 with an NVIDIA GPU's other settings: decode steps on 8 rows,
    and forward passes reading their inputs from buffers of fixed addresses."""
    from support.engine import gpu_kernel_settings

    with gpu_kernel_settings(decode_rows=8, fixed_inputs=True):
        check_greedy_tokens_and_shards(checkpoint, 2, HEADS, KV_HEADS, HEAD_DIM, "pallas")


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
    env["JAXLLM_COMPILATION_CACHE"] = ""
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
        group = HEADS // KV_HEADS
        assert result["qkv_proj_shards"] == [[HIDDEN, KV_HEADS // 4, group + 2, HEAD_DIM]] * 2
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
    qkv_proj = llm.engine.runner.params["layers_0"]["attn"]["qkv_proj"]
    result = {
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "qkv_proj_shards": [list(shard.data.shape) for shard in qkv_proj.addressable_shards],
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


def test_logprobs_at_tp2_equal_tp1(checkpoint):
    from support.engine import make_llm_with

    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    runs = []
    for tp in (1, 2):
        llm = make_llm_with(checkpoint[0], None, tensor_parallel_size=tp, **SETTINGS)
        runs.append(
            [out.outputs[0] for out in llm.generate(make_prompts(), params, use_tqdm=False)]
        )
    for one, two in zip(*runs, strict=True):
        assert one.token_ids == two.token_ids
        for a, b in zip(one.logprobs, two.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[i].logprob - b[i].logprob) < 1e-4 for i in a)
