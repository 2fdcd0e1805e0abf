"""The runner's programs kept on disk: a second start loads them without tracing, a model that
differs only in a value baked into its programs gets its own (and shares the samplers), and a
damaged file is compiled again (`jaxllm.executables`)."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import io_callback
from support.engine import BASE_SETTINGS, NUM_GREEDY_TOKENS, greedy_params, make_llm_with
from support.hf import save_checkpoint

from jaxllm import startup
from jaxllm.executables import STALE_DAYS, ExecutableStore
from jaxllm.model import attention
from jaxllm.model.attention import LOOP_COMMAND_BUFFERS

# A short ladder compiled at start-up: 2 decode sizes, prefill chunks of 16 and 32 tokens, tables
# of 1 - 8 blocks (the prompts below take up to 100 + 24 tokens).
SETTINGS = BASE_SETTINGS | dict(
    max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128, compile_at_startup=True
)
STEP_PROGRAMS = {"forward_step", "decode_steps", "sample_step", "logprob_step"}


@pytest.fixture
def compilation_cache(tmp_path, monkeypatch):
    """A compilation cache of this test's own for the engines it starts: the store lives in
    it, whatever the process's cache."""
    monkeypatch.setattr(startup, "configure_compilation_cache", lambda: tmp_path / "cache")


def traced_step_programs(build):
    """The step programs traced while `build()` runs, and what it returns."""
    traced = []

    def on_span(event: str, start: float, end: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_time_span_listener(on_span)
    try:
        result = build()
    finally:
        jax.monitoring.unregister_event_time_span_listener(on_span)
    return [name for name in traced if name in STEP_PROGRAMS], result


def test_a_second_start_loads_every_program_and_another_rotation_gets_its_own_model_programs(
    compilation_cache, greedy_prompts, tmp_path
):
    # the same weights (seed 0): only the rotation tells the two models apart
    model = save_checkpoint(tmp_path / "model", rope_theta=10_000.0)
    other = save_checkpoint(tmp_path / "other", rope_theta=1_000.0)
    make_llm_with(model.path, **SETTINGS)
    traced, second = traced_step_programs(lambda: make_llm_with(model.path, **SETTINGS))
    assert traced == []
    runner = second.engine.runner
    assert runner.executables.num_loaded == runner.num_executables > 0
    # its model's programs its own, the samplers' shared (the same vocabulary)
    traced, third = traced_step_programs(lambda: make_llm_with(other.path, **SETTINGS))
    assert set(traced) == {"forward_step"}
    runner = third.engine.runner
    assert runner.executables.num_loaded == runner.num_executables - len(traced) > 0
    prompts = greedy_prompts[5:8]  # 33 to 100 tokens
    expected = {
        name: [checkpoint.greedy(prompt, NUM_GREEDY_TOKENS) for prompt in prompts]
        for name, checkpoint in (("model", model), ("other", other))
    }
    assert expected["model"] != expected["other"]
    for name, llm in (("model", second), ("other", third)):
        outputs = llm.generate(prompts, greedy_params(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected[name]


def test_the_store_keeps_loads_and_recompiles_a_damaged_program(tmp_path, caplog):
    stale, recent = tmp_path / "0123456789abcdef", tmp_path / "fedcba9876543210"
    for folder in (stale, recent):
        (folder / "program.executable").parent.mkdir()
        (folder / "program.executable").write_bytes(b"")
    days_ago = time.time() - (STALE_DAYS + 1) * 24 * 3600
    os.utime(stale, (days_ago, days_ago))
    store = ExecutableStore(tmp_path, jax.devices()[:1])
    # another environment's programs: kept a while (two checkouts in turn), then deleted
    assert recent.exists() and not stale.exists()
    factor = random.random()  # a program new to JAX's cache (whose programs are not stored)
    twice = jax.jit(lambda x: factor * x)
    x = jnp.arange(4.0)
    key = store.key("twice", x, {})
    assert key not in store
    compiled = store.compile(twice.lower(x), {}, key)
    assert key in store and store.key("twice", x, {}) == key
    assert store.key("twice", jnp.arange(4), {}) != key  # another dtype, another program
    assert store.key("twice", x, {"xla_gpu_enable_triton_gemm": False}) != key
    loaded = store.load(key)
    assert store.num_loaded == 1
    assert (loaded(x) == compiled(x)).all() and (loaded(x) == factor * x).all()
    path = next(store.directory.glob("*.executable"))
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="jaxllm.executables"):
        assert store.load(key) is None
    assert "could not load" in caplog.text
    assert store.num_loaded == 1


def test_a_program_from_jaxs_cache_is_not_stored(tmp_path):
    if startup.configure_compilation_cache() is None:
        pytest.skip("$JAXLLM_COMPILATION_CACHE is empty: JAX's cache is off, nothing comes from it")
    store = ExecutableStore(tmp_path, jax.devices()[:1])
    factor = random.random()  # a program new to JAX's cache
    x = jnp.arange(4.0)
    jax.jit(lambda x: 3 * factor * x).lower(x).compile()  # outside the store: JAX's cache keeps it
    key = store.key("thrice", x, {})
    compiled = store.compile(jax.jit(lambda x: 3 * factor * x).lower(x), {}, key)
    assert key not in store and (compiled(x) == 3 * factor * x).all()


def test_a_program_with_a_host_callback_runs_unstored(tmp_path, caplog):
    """Its callback is a Python function, which does not pickle: a warning, not an error."""
    store = ExecutableStore(tmp_path, jax.devices()[:1])
    factor = random.random()
    seen = []

    def host(x):
        seen.append(x)
        return x

    def with_callback(x):
        return io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), factor * x)

    x = jnp.arange(4.0)
    key = store.key("with_callback", x, {})
    with caplog.at_level(logging.WARNING, logger="jaxllm.executables"):
        compiled = store.compile(jax.jit(with_callback).lower(x), {}, key)
    assert "could not store an executable" in caplog.text and key not in store
    assert (compiled(x) == factor * x).all() and len(seen) == 1


@pytest.mark.parametrize("directory", ["none", "under a file"])
def test_without_a_directory_nothing_is_kept(directory, tmp_path, caplog):
    blocker = tmp_path / "file"  # a cache it cannot make, as in a read-only home
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="jaxllm.executables"):
        store = ExecutableStore(None if directory == "none" else blocker / "cache")
    assert store.directory is None
    assert ("no store of executables" in caplog.text) == (directory != "none")
    twice = jax.jit(lambda x: 2 * x)
    x = jnp.arange(4.0)
    key = store.key("twice", x)
    assert key == "" and key not in store
    assert (store.compile(twice.lower(x), {}, key)(x) == 2 * x).all()


@pytest.mark.gpu
def test_programs_loaded_on_the_gpu_give_the_tokens_of_the_compiled_ones(
    compilation_cache, greedy_prompts, tmp_path
):
    # a head dim FlashAttention-3 takes; rope_theta unique to this run: every program compiled
    shape = dict(tied=True, num_heads=4, num_kv_heads=1, head_dim=64, hidden=128, layers=2)
    model = save_checkpoint(tmp_path / "model", rope_theta=10_000.0 + random.random(), **shape)
    # the GPU's defaults (bf16, compiled at start-up, several decode steps a plan), a small ladder
    settings = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=256)
    first = make_llm_with(model.path, num_kvcache_blocks=16, **settings)
    second = make_llm_with(model.path, num_kvcache_blocks=16, **settings)
    runner = second.engine.runner
    assert runner.executables.num_loaded == runner.num_executables > 0
    prompts = greedy_prompts[:6]
    tokens = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params(), use_tqdm=False)]
        for llm in (first, second)
    ]
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
def test_a_plans_loop_in_its_cuda_graph_gives_the_tokens_of_the_loop_run_from_the_host(
    compilation_cache, greedy_prompts, tmp_path, monkeypatch
):
    """Multi-step programs run their loop inside their CUDA graph (`LOOP_COMMAND_BUFFERS`):
    the tokens of the same programs with XLA's default graphs, which leave the loop to the
    host."""
    shape = dict(tied=True, num_heads=4, num_kv_heads=1, head_dim=64, hidden=128, layers=2)
    model = save_checkpoint(tmp_path / "model", rope_theta=10_000.0 + random.random(), **shape)
    settings = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=256)
    host_loop = LOOP_COMMAND_BUFFERS.replace(",WHILE,CONDITIONAL", "")
    tokens = []
    for kinds in (LOOP_COMMAND_BUFFERS, host_loop):
        monkeypatch.setattr(attention, "LOOP_COMMAND_BUFFERS", kinds)
        llm = make_llm_with(model.path, num_kvcache_blocks=16, **settings)
        outputs = llm.generate(greedy_prompts[:4], greedy_params(), use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        assert llm.engine.stats.decode.forward_passes > 2 * llm.engine.stats.decode.steps
    assert "WHILE" not in host_loop and tokens[0] == tokens[1]


def test_a_cache_directory_that_cannot_be_made_leaves_the_engine_working(tmp_path):
    """`$JAXLLM_COMPILATION_CACHE` under a file: `LLM()` warns, compiles what it needs, keeps
    nothing, and generates (a process of its own: the cache is set once per process)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = dict(os.environ, JAXLLM_COMPILATION_CACHE=str(blocker / "cache"), JAX_PLATFORMS="cpu")
    script = (
        "from jaxllm import LLM, SamplingParams\n"
        "llm = LLM(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32)\n"
        "output = llm.generate(['Hello'], SamplingParams(max_tokens=4, temperature=0))[0]\n"
        "print('tokens', len(output.outputs[0].token_ids), llm.engine.runner.executables.directory)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens 4 None" in run.stdout
    assert "no compilation cache (set JAXLLM_COMPILATION_CACHE)" in run.stderr


def test_another_cache_directory_once_one_is_set_gets_a_warning(tmp_path, monkeypatch, caplog):
    current = startup.configure_compilation_cache()
    if current is None:
        pytest.skip("$JAXLLM_COMPILATION_CACHE is empty: JAX's cache is off")
    monkeypatch.setenv(startup.COMPILATION_CACHE_ENV, str(tmp_path / "another"))
    with caplog.at_level(logging.WARNING, logger="jaxllm.startup"):
        assert startup.configure_compilation_cache() == current  # the process's, still
    assert f"{tmp_path / 'another'} is not used" in caplog.text
    monkeypatch.setenv(startup.COMPILATION_CACHE_ENV, str(current))
    caplog.clear()
    startup.configure_compilation_cache()
    assert "is not used" not in caplog.text
