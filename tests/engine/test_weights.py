"""New weights for a running engine, and sleep: `update_params` gives the outputs of a fresh LLM
built from the new weights (no stale prefix-cache hit, nothing compiled), `sleep`/`wake_up`
free and restore the KV cache, and wrong trees or calls at the wrong time are refused with the
engine left working."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.engine import BASE_SETTINGS, assert_idle, greedy_params
from support.hf import save_checkpoint

from jaxllm import LLM, SamplingParams
from jaxllm.research.bench import count_compilations

NUM_TOKENS = 10


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """The engine tests' shape with other random weights."""
    return save_checkpoint(tmp_path_factory.mktemp("qwen3-other-weights"), seed=1)


@pytest.fixture(scope="module")
def other_llm(other_checkpoint) -> LLM:
    return LLM(str(other_checkpoint.path), **BASE_SETTINGS)


@pytest.fixture
def fresh_llm(checkpoint) -> LLM:
    """An engine of its own: these tests change its weights."""
    return LLM(str(checkpoint.path), **BASE_SETTINGS)


def tokens(outputs) -> list[list[int]]:
    return [output.token_ids for output in outputs]


def test_update_params_gives_the_new_weights_outputs_without_compiling(
    fresh_llm, other_llm, other_checkpoint, greedy_prompts
):
    prompts, params = greedy_prompts[3:8], greedy_params(NUM_TOKENS)
    before = tokens(fresh_llm.generate(prompts, params, use_tqdm=False))
    tokens(fresh_llm.generate(prompts, params, use_tqdm=False))  # its blocks now cached
    assert fresh_llm.cache_stats().num_cached_free_blocks > 0

    compilations = count_compilations()
    fresh_llm.update_params(other_llm.params)
    after = tokens(fresh_llm.generate(prompts, params, use_tqdm=False))
    assert compilations == []

    expected = [other_checkpoint.greedy(prompt, NUM_TOKENS) for prompt in prompts]
    assert after == expected == tokens(other_llm.generate(prompts, params, use_tqdm=False))
    assert after != before
    assert fresh_llm.params is not None
    assert_idle(fresh_llm)


def test_update_params_uses_placed_arrays_as_they_are(fresh_llm, other_llm):
    fresh_llm.update_params(other_llm.params)
    new, used = jax.tree.leaves(other_llm.params), jax.tree.leaves(fresh_llm.params)
    assert all(a is b for a, b in zip(new, used, strict=True))
    host = jax.tree.map(np.asarray, other_llm.params)  # numpy leaves are copied to the devices
    fresh_llm.update_params(host)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(fresh_llm.params))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda tree: {**tree, "extra": np.zeros(1, np.float32)}, "tree structure"),
        (lambda tree: {k: v for k, v in tree.items() if k != sorted(tree)[0]}, "tree structure"),
        (lambda tree: jax.tree.map(lambda x: x[..., :1], tree), "the model's is"),
        (lambda tree: jax.tree.map(lambda x: x.astype(np.float16), tree), "float16"),
        (lambda tree: jax.tree.map(deleted_copy, tree), "was deleted"),
    ],
    ids=["extra leaf", "missing leaf", "shape", "dtype", "deleted"],
)
def test_a_wrong_tree_is_refused_and_the_engine_keeps_its_weights(
    change, message, fresh_llm, checkpoint, greedy_prompts
):
    prompt = greedy_prompts[4]
    old = jax.tree.leaves(fresh_llm.params)
    with pytest.raises(ValueError, match=message):
        fresh_llm.update_params(change(fresh_llm.params))
    assert all(a is b for a, b in zip(old, jax.tree.leaves(fresh_llm.params), strict=True))
    (output,) = fresh_llm.generate([prompt], greedy_params(NUM_TOKENS), use_tqdm=False)
    assert output.token_ids == checkpoint.greedy(prompt, NUM_TOKENS)


def deleted_copy(array: jax.Array) -> jax.Array:
    copy = jnp.copy(array)
    copy.delete()
    return copy


def test_weights_deleted_after_update_params_are_named_and_replaceable(
    fresh_llm, checkpoint, greedy_prompts
):
    # a trainer's step that donates arrays the engine runs deletes them
    prompt, params = greedy_prompts[4], greedy_params(NUM_TOKENS)
    fresh_llm.update_params(jax.tree.map(jnp.copy, fresh_llm.params))
    scale = jnp.copy(fresh_llm.params["final_norm"]["scale"])
    fresh_llm.params["final_norm"]["scale"].delete()
    with pytest.raises(RuntimeError, match=r"params\['final_norm'\]\['scale'\] was deleted"):
        fresh_llm.generate([prompt], params, use_tqdm=False)
    assert_idle(fresh_llm)

    live = jax.tree.map(lambda x: scale if x.is_deleted() else x, fresh_llm.params)
    fresh_llm.update_params(live)
    (output,) = fresh_llm.generate([prompt], params, use_tqdm=False)
    assert output.token_ids == checkpoint.greedy(prompt, NUM_TOKENS)


def test_sleep_frees_the_kv_cache_and_wake_up_restores_it(fresh_llm, checkpoint, greedy_prompts):
    prompts, params = greedy_prompts[2:5], greedy_params(NUM_TOKENS)
    expected = [checkpoint.greedy(prompt, NUM_TOKENS) for prompt in prompts]
    assert tokens(fresh_llm.generate(prompts, params, use_tqdm=False)) == expected
    kv_cache = jax.tree.leaves(fresh_llm.engine.runner.kv_cache)

    fresh_llm.sleep()
    assert all(array.is_deleted() for array in kv_cache)
    with pytest.raises(RuntimeError, match="asleep"):
        fresh_llm.generate(prompts, params, use_tqdm=False)
    assert fresh_llm.cache_stats().num_cached_free_blocks == 0

    compilations = count_compilations()
    fresh_llm.wake_up()
    assert tokens(fresh_llm.generate(prompts, params, use_tqdm=False)) == expected
    assert compilations == []
    assert_idle(fresh_llm)


def test_a_stream_made_before_sleep_refuses_to_start_and_the_llm_stays_asleep(
    fresh_llm, checkpoint, greedy_prompts
):
    prompt, params = greedy_prompts[4], greedy_params(NUM_TOKENS)
    stream = fresh_llm.stream(prompt, params)  # queued at its first next()
    fresh_llm.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        next(stream)
    assert fresh_llm.engine.runner.kv_cache is None
    assert not fresh_llm.engine.has_unfinished()
    fresh_llm.engine.reset()  # as after a failed step: what sleeps stays asleep
    assert fresh_llm.engine.runner.kv_cache is None
    fresh_llm.wake_up()
    (output,) = fresh_llm.generate([prompt], params, use_tqdm=False)
    assert output.token_ids == checkpoint.greedy(prompt, NUM_TOKENS)
    assert_idle(fresh_llm)


def test_sleep_level_2_drops_the_weights_until_an_update(
    fresh_llm, other_llm, other_checkpoint, greedy_prompts, tmp_path
):
    prompt, params = greedy_prompts[5], greedy_params(NUM_TOKENS)
    fresh_llm.sleep(level=2)
    assert fresh_llm.params is None
    with pytest.raises(RuntimeError, match="no weights to save"):
        fresh_llm.save(tmp_path / "saved")
    assert list(tmp_path.iterdir()) == []  # nothing written
    fresh_llm.wake_up()
    with pytest.raises(RuntimeError, match="update_params"):
        fresh_llm.generate([prompt], params, use_tqdm=False)
    fresh_llm.update_params(other_llm.params)
    (output,) = fresh_llm.generate([prompt], params, use_tqdm=False)
    assert output.token_ids == other_checkpoint.greedy(prompt, NUM_TOKENS)
    for level in (3, 2.0, True):  # NOTE: 2.0 == 2 and True == 1 are not levels either
        with pytest.raises(ValueError, match="level"):
            fresh_llm.sleep(level=level)
    assert fresh_llm.params is not None


def test_no_update_or_sleep_while_a_stream_runs(fresh_llm, other_llm, checkpoint, greedy_prompts):
    prompt, params = greedy_prompts[6], greedy_params(NUM_TOKENS)
    stream = fresh_llm.stream(prompt, params)
    first = next(stream)
    for call in (lambda: fresh_llm.update_params(other_llm.params), fresh_llm.sleep):
        with pytest.raises(RuntimeError, match="requests are running"):
            call()
    streamed = list(first.token_ids) + [t for delta in stream for t in delta.token_ids]
    assert streamed == checkpoint.greedy(prompt, NUM_TOKENS)
    assert_idle(fresh_llm)


def test_update_params_takes_hugging_face_names(fresh_llm, other_checkpoint, greedy_prompts):
    named = {
        name: tensor.numpy() for name, tensor in other_checkpoint.torch_model.state_dict().items()
    }
    prompts, params = greedy_prompts[3:6], greedy_params(NUM_TOKENS)
    fresh_llm.update_params(named)
    expected = [other_checkpoint.greedy(prompt, NUM_TOKENS) for prompt in prompts]
    assert tokens(fresh_llm.generate(prompts, params, use_tqdm=False)) == expected

    del named["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"no model\.layers\.1\.mlp\.up_proj\.weight"):
        fresh_llm.update_params(named)


def test_host_arrays_are_copied_so_their_owner_may_reuse_them(fresh_llm, other_checkpoint):
    """numpy leaves, in the model's tree or by Hugging Face names, are copied: a trainer that
    writes into its host buffers afterwards leaves the engine's weights as they were."""
    host = jax.tree.map(np.array, fresh_llm.params)
    state = other_checkpoint.torch_model.state_dict()
    named = {name: tensor.numpy().copy() for name, tensor in state.items()}
    for update in (host, named):
        fresh_llm.update_params(update)
        served = jax.tree.map(np.array, fresh_llm.params)
        for leaf in jax.tree.leaves(update):
            leaf[...] = 0
        assert jax.tree.all(jax.tree.map(np.array_equal, served, fresh_llm.params))


def test_hugging_face_names_are_cast_to_the_models_dtype(fresh_llm, other_checkpoint):
    """A trainer's bfloat16 state dict runs in a float32 engine, as a bfloat16 checkpoint
    loads: each tensor cast; integer tensors are refused, named."""
    state = other_checkpoint.torch_model.state_dict()
    bf16 = {name: jnp.asarray(tensor.numpy(), jnp.bfloat16) for name, tensor in state.items()}
    rounded = {name: np.asarray(array, np.float32) for name, array in bf16.items()}
    fresh_llm.update_params(bf16)
    from_bf16 = jax.tree.map(np.asarray, fresh_llm.params)
    fresh_llm.update_params(rounded)
    assert jax.tree.all(jax.tree.map(np.array_equal, from_bf16, fresh_llm.params))
    assert {leaf.dtype for leaf in jax.tree.leaves(fresh_llm.params)} == {np.dtype(np.float32)}

    name = "model.norm.weight"
    with pytest.raises(ValueError, match=rf"{name} is int32; weights are floating point"):
        fresh_llm.update_params(rounded | {name: np.ones(state[name].shape, np.int32)})
    fresh_llm.update_params({name: tensor.numpy() for name, tensor in state.items()})
    from_numpy = jax.tree.map(np.asarray, fresh_llm.params)
    fresh_llm.update_params(dict(state))  # torch tensors, as a state dict holds them
    assert jax.tree.all(jax.tree.map(np.array_equal, from_numpy, fresh_llm.params))
    # a trainer's own: bfloat16, and parameters that require grad
    fresh_llm.update_params({name: tensor.bfloat16() for name, tensor in state.items()})
    assert jax.tree.all(jax.tree.map(np.array_equal, from_bf16, fresh_llm.params))
    fresh_llm.update_params(dict(other_checkpoint.torch_model.named_parameters()))
    assert jax.tree.all(jax.tree.map(np.array_equal, from_numpy, fresh_llm.params))


def test_donated_arrays_are_placed_by_giving_up_their_buffers(fresh_llm, other_llm, monkeypatch):
    """`donate=True` hands each array that needs placing to `jax.device_put(..., donate=True)`
    (a CPU may keep the buffer; a GPU reuses it), and the outputs are the new weights'."""
    calls = []
    real = jax.device_put
    monkeypatch.setattr(
        jax, "device_put", lambda x, *a, **k: calls.append(k.get("donate")) or real(x, *a, **k)
    )
    elsewhere = jax.devices()[-1]  # not the engine's device: placing copies
    moved = jax.tree.map(lambda x: jax.device_put(np.asarray(x), elsewhere), other_llm.params)
    calls.clear()
    fresh_llm.update_params(moved, donate=True)
    assert calls and all(calls)
    prompt, params = [[5, 6, 7]], greedy_params()
    expected = other_llm.generate(prompt, params, use_tqdm=False)[0].token_ids
    assert fresh_llm.generate(prompt, params, use_tqdm=False)[0].token_ids == expected


def test_a_bad_leaf_gives_up_no_donated_array(fresh_llm, other_llm, monkeypatch):
    """Every leaf is checked before any is placed: a refused tree leaves the caller's arrays
    alive, donated or not."""
    elsewhere = jax.devices()[-1]  # not the engine's device: each leaf needs placing
    assert elsewhere not in jax.tree.leaves(fresh_llm.params)[0].devices()
    moved = jax.tree.map(lambda x: jax.device_put(np.asarray(x), elsewhere), other_llm.params)
    leaves, structure = jax.tree.flatten(moved)
    leaves[-1] = leaves[-1].astype(np.float16)
    calls = []
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(k) or None)
    with pytest.raises(ValueError, match="is float16"):
        fresh_llm.update_params(jax.tree.unflatten(structure, leaves), donate=True)
    assert calls == []


def test_update_and_sleep_right_after_a_request_stopped_on_a_stop_token(
    fresh_llm, other_llm, other_checkpoint, greedy_prompts
):
    """A sequence that stops on a stop token leaves a step planned past it in flight; once
    generate returned, update_params and sleep go ahead."""
    prompt = greedy_prompts[4]
    stop = fresh_llm.generate(prompt, greedy_params(1), use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop_token_ids=stop)
    (output,) = fresh_llm.generate(prompt, params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop"
    assert fresh_llm.engine.has_unfinished()  # the step planned past the stop token
    fresh_llm.update_params(other_llm.params)
    (after,) = fresh_llm.generate(prompt, greedy_params(NUM_TOKENS), use_tqdm=False)
    assert after.outputs[0].token_ids == other_checkpoint.greedy(prompt, NUM_TOKENS)
    fresh_llm.generate(prompt, params, use_tqdm=False)
    fresh_llm.sleep()
    fresh_llm.wake_up()
    assert_idle(fresh_llm)
