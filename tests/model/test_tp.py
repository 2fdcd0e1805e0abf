"""Tensor parallelism on emulated CPU devices: sharded params, sharded loading, and logits under
the mesh equal to the unsharded model's and to transformers'."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
import torch
import transformers
from support.hf import VOCAB_SIZE, random_qwen3
from support.inputs import Chunk, build_inputs, relative_error

from jaxllm import weights
from jaxllm.model.attention import Kernels
from jaxllm.model.checkpoint import load_params, save_params
from jaxllm.model.config import Qwen3Config
from jaxllm.model.kv_cache import allocate_kv_cache
from jaxllm.model.loader import load_hf_checkpoint
from jaxllm.model.qwen3 import forward, init_params, sharded_forward, sharded_param_shapes
from jaxllm.model.sharding import (
    check_tensor_parallel,
    gspmd_partitioner,
    make_mesh,
    partitioner_for,
)
from jaxllm.weights import from_hf_names

# 8 query heads, 4 kv heads, head dim 64, hidden 128 (ffn 288), 2 layers.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 8, 4, 64, 128, 2
SHAPE = dict(
    num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden=HIDDEN, layers=LAYERS
)
BLOCK_SIZE, NUM_BLOCKS, TABLE_WIDTH = 8, 16, 4

# Param path ("layer" for any "layers_{i}") -> the axis sharded over "tp" (None: replicated).
SHARDED_AXIS = {
    ("embed",): 0,
    ("lm_head",): 1,
    ("final_norm", "scale"): None,
    ("layer", "attn_norm", "scale"): None,
    ("layer", "mlp_norm", "scale"): None,
    ("layer", "attn", "q_norm", "scale"): None,
    ("layer", "attn", "k_norm", "scale"): None,
    ("layer", "attn", "qkv_proj"): 1,
    ("layer", "attn", "o_proj"): 0,
    ("layer", "mlp", "gate_up_proj"): 2,
    ("layer", "mlp", "down_proj"): 0,
}


def sharded_axis(name: tuple[str, ...]) -> int | None:
    return SHARDED_AXIS[("layer", *name[1:]) if name[0].startswith("layers_") else name]


@pytest.fixture(scope="module", params=["tied", "untied"])
def checkpoint(request, tmp_path_factory):
    tied = request.param == "tied"
    model = random_qwen3(tied=tied, **SHAPE)
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    model.save_pretrained(path)
    config, params = load_params(path, dtype="float32")
    return path, model, config, params


def leaves_by_path(params) -> dict[tuple[str, ...], jax.Array]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {tuple(key.key for key in path): leaf for path, leaf in flat}


@pytest.mark.parametrize("tp", [2, 4])
def test_loaded_params_are_sharded_blocks_of_the_unsharded_ones(checkpoint, tp):
    path, _, _, reference = checkpoint
    _, params = load_params(path, dtype="float32", mesh=make_mesh(tp))

    expected = leaves_by_path(reference)
    assert set(leaves_by_path(params)) == set(expected)
    for name, array in leaves_by_path(params).items():
        axis = sharded_axis(name)
        local_shape = list(array.shape)
        if axis is not None:
            local_shape[axis] //= tp
        assert len(array.addressable_shards) == tp, name
        for shard in array.addressable_shards:
            assert shard.data.shape == tuple(local_shape), name
            np.testing.assert_array_equal(shard.data, np.asarray(expected[name])[shard.index])


@pytest.mark.parametrize(("tp", "jax_embedding"), [(2, False), (4, False), (2, True)])
def test_weights_by_name_are_read_into_each_devices_blocks(checkpoint, tp, jax_embedding):
    """`LLM.update_params` with a trainer's state dict: host tensors go to their devices' blocks
    as a checkpoint's do, not whole to one device; beside a jax array too (which stays where it
    is until the params are placed)."""
    _, model, config, reference = checkpoint
    shapes = sharded_param_shapes(config, make_mesh(tp))
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    if jax_embedding:
        state["model.embed_tokens.weight"] = jax.numpy.asarray(state["model.embed_tokens.weight"])

    params = from_hf_names(state, config, shapes)

    expected, placements = leaves_by_path(reference), leaves_by_path(shapes)
    assert set(leaves_by_path(params)) == set(expected)
    for name, array in leaves_by_path(params).items():
        if name != ("embed",) or not jax_embedding:
            assert array.sharding.is_equivalent_to(placements[name].sharding, array.ndim), name
        np.testing.assert_array_equal(np.asarray(array), np.asarray(expected[name]))


def test_weights_by_name_are_taken_to_the_host_one_param_at_a_time(checkpoint, monkeypatch):
    """A trainer's state dict of bf16 (or GPU) tensors becomes float32 numpy on the host: one
    param's tensors at a time, sent before the next are taken, never the whole model at once."""
    _, model, config, _ = checkpoint
    state = {
        name: tensor.detach().to(torch.bfloat16) for name, tensor in model.state_dict().items()
    }
    events = []
    take, send = weights._from_torch, jax.device_put
    monkeypatch.setattr(weights, "_from_torch", lambda t: events.append("take") or take(t))
    monkeypatch.setattr(
        jax, "device_put", lambda x, *a, **k: events.append("send") or send(x, *a, **k)
    )

    from_hf_names(state, config, sharded_param_shapes(config, make_mesh(2)))

    assert events.count("take") == len(state) - config.tie_word_embeddings
    assert events.index("send") < len(events) - events[::-1].index("take")


def tiny_config(**overrides) -> Qwen3Config:
    """The config of this file's checkpoint shape (see the constants above)."""
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=288,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        **overrides,
    )


def test_random_init_and_orbax_are_sharded_and_mesh_independent(tmp_path):
    config = tiny_config(tie_word_embeddings=False, dtype="float32")
    unsharded = init_params(config, seed=3)
    sharded = init_params(config, seed=3, mesh=make_mesh(2))
    qkv_proj = sharded["layers_0"]["attn"]["qkv_proj"]
    group = HEADS // KV_HEADS
    assert qkv_proj.addressable_shards[0].data.shape == (HIDDEN, KV_HEADS // 2, group + 2, HEAD_DIM)
    jax.tree.map(np.testing.assert_array_equal, sharded, unsharded)

    save_params(tmp_path / "ckpt", config, sharded)
    _, restored = load_params(tmp_path / "ckpt", mesh=make_mesh(4))
    down_proj = restored[f"layers_{LAYERS - 1}"]["mlp"]["down_proj"]
    assert down_proj.addressable_shards[0].data.shape == (288 // 4, HIDDEN)
    jax.tree.map(np.testing.assert_array_equal, restored, unsharded)


@pytest.mark.parametrize("tp", [1, 4])
def test_sharded_loading_sends_each_device_its_block_only(tmp_path, monkeypatch, tp):
    """The host builds and sends one device's block at a time (so host memory holds one block,
    not a param or the model), and every device gets only its own blocks."""
    ffn = 1024
    model = random_qwen3(tied=True, **SHAPE)
    model.config.intermediate_size = ffn
    transformers.Qwen3ForCausalLM(model.config).save_pretrained(tmp_path)
    sent = []
    device_put = jax.device_put

    def recording_device_put(x, device=None, **kwargs):
        sent.append((x.nbytes, device))
        return device_put(x, device, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording_device_put)
    config, params = load_hf_checkpoint(tmp_path, progress=False, mesh=make_mesh(tp))
    monkeypatch.undo()

    gate_up_bytes = HIDDEN * 2 * ffn * 4  # one layer's gate_up_proj, the largest param
    model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    sharded_bytes = model_bytes - sum(
        leaf.nbytes for name, leaf in leaves_by_path(params).items() if sharded_axis(name) is None
    )
    assert max(nbytes for nbytes, _ in sent) == gate_up_bytes // tp
    for device in jax.devices()[:tp]:
        received = sum(nbytes for nbytes, target in sent if target == device)
        assert received == (model_bytes - sharded_bytes) + sharded_bytes // tp
    assert config.intermediate_size == ffn


def test_tensor_parallel_size_must_divide_heads(tmp_path):
    model = random_qwen3(tied=True, **SHAPE | dict(num_heads=4, num_kv_heads=2))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"num_heads \(4\) and num_kv_heads \(2\)"):
        load_params(tmp_path, mesh=make_mesh(4))
    config = Qwen3Config.from_hf(tmp_path)
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match=r"num_heads \(4\) and num_kv_heads \(2\)"):
        check_tensor_parallel(config, 8)
    available = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs that many devices, {available} available"):
        make_mesh(2 * available)


def run_steps(step, params, cache, steps):
    """Runs (inputs) steps through `step`; returns the logits of each as numpy."""
    logits = []
    for inputs in steps:
        out, cache = step(params, cache, inputs)
        logits.append(np.asarray(out))
    return logits, cache


@pytest.mark.parametrize(
    ("tp", "gspmd", "decode_rows"), [(2, False, 1), (4, False, 1), (2, True, 1), (2, False, 8)]
)
def test_logits_under_the_mesh_match_the_unsharded_model(checkpoint, tp, gspmd, decode_rows):
    """Also lowered for the GSPMD partitioner, which TP steps with FlashAttention use, and with
    decode steps on padding rows (`Kernels.decode_rows`, as on an NVIDIA GPU)."""
    path, torch_model, config, params = checkpoint
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB_SIZE, n).tolist() for n in (13, 6)]
    decoded = [rng.integers(0, VOCAB_SIZE, 3).tolist() for _ in prompts]
    tables = [[3, 9, 1, 12], [7, 0, 5, 14]]
    prefill = [Chunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    steps = [build_inputs(prefill, BLOCK_SIZE, 4, TABLE_WIDTH)]
    for i in range(3):
        chunks = [
            Chunk([d[i]], len(p) + i, t) for p, d, t in zip(prompts, decoded, tables, strict=True)
        ]
        steps.append(build_inputs(chunks, BLOCK_SIZE, 1, TABLE_WIDTH, num_tiles=4))

    unsharded = jax.jit(forward, static_argnums=1, donate_argnums=2)
    cache = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE)
    expected, _ = run_steps(
        lambda *args: unsharded(args[0], config, *args[1:]), params, cache, steps
    )

    mesh = make_mesh(tp)
    _, sharded_params = load_params(path, dtype="float32", mesh=mesh)
    cache = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, mesh=mesh)
    step = jax.jit(
        sharded_forward(config, mesh, Kernels(decode_rows=decode_rows)), donate_argnums=1
    )
    with gspmd_partitioner() if gspmd else contextlib.nullcontext():
        got, cache = run_steps(step, sharded_params, cache, steps)

    assert cache.keys.addressable_shards[0].data.shape == (
        LAYERS,
        NUM_BLOCKS,
        BLOCK_SIZE,
        KV_HEADS // tp,
        HEAD_DIM,
    )
    for actual, reference in zip(got, expected, strict=True):
        assert actual.shape == reference.shape
        assert relative_error(actual, reference) <= 1e-5
    # The last decode step against transformers over each whole sequence.
    for row, (prompt, tokens) in enumerate(zip(prompts, decoded, strict=True)):
        with torch.no_grad():
            hf = torch_model(torch.tensor([prompt + tokens])).logits[0, -1].numpy()
        assert relative_error(got[-1][row], hf) <= 1e-4


def test_only_steps_with_custom_calls_under_a_mesh_use_the_gspmd_partitioner():
    default = jax.config.jax_use_shardy_partitioner
    flash, portable = Kernels("flash", "pallas"), Kernels()
    cases = [(flash, 2, False), (flash, 1, default), (portable, 2, default)]
    for kernels, tp, shardy in cases:
        with partitioner_for(make_mesh(tp), kernels.custom_calls):
            assert jax.config.jax_use_shardy_partitioner is shardy
        assert jax.config.jax_use_shardy_partitioner is default
