"""The rest of the public API: stream, save, the one-call `jaxllm.generate`, prompt forms."""

from __future__ import annotations

import _thread
import concurrent.futures
import dataclasses
import gc
import json
import re
import shutil
import threading
import time
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from support.engine import BASE_SETTINGS, assert_idle, greedy_params

import jaxllm
import jaxllm.notebook
from jaxllm import LLM, SamplingParams, startup
from jaxllm.cache import LRUPolicy
from jaxllm.model import checkpoint as checkpoint_module
from jaxllm.model.checkpoint import MANIFEST_FILE
from jaxllm.model.loader import CheckpointError
from jaxllm.platform import Platform
from jaxllm.runner import ModelRunner
from jaxllm.startup import engine_settings

PROMPT = "The capital of France is"
# A small ladder compiled (and warmed up) at start-up: 2 decode sizes, prefill chunks of 16 and
# 32 tokens, tables of 1 - 4 blocks.
COMPILED_AT_STARTUP = BASE_SETTINGS | {
    "max_num_seqs": 2,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "compile_at_startup": True,
}


def joined(deltas) -> tuple[str, list[int]]:
    deltas = list(deltas)
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, stop=[" the", "ing "]),
    ],
    ids=["seeded", "greedy", "stop-strings"],
)
def test_stream_equals_generate(text_llm, params):
    (output,) = text_llm.generate([PROMPT], params, use_tqdm=False)

    deltas = list(text_llm.stream(PROMPT, params))

    assert joined(deltas) == (output.text, output.token_ids)
    assert len(deltas) >= len(output.token_ids)  # a delta per step
    reasons = [(delta.finish_reason, delta.stop_reason) for delta in deltas]
    done = output.outputs[0]
    assert reasons == [(None, None)] * (len(deltas) - 1) + [(done.finish_reason, done.stop_reason)]
    assert done.finish_reason is not None
    assert_idle(text_llm)


def test_reset_prefix_cache_empties_it_unless_requests_run(llm):
    """vLLM's `reset_prefix_cache`: the prompt run again hits nothing after it, and while a
    stream runs it refuses (False) and changes nothing."""
    prompt, params = list(range(1, 60)), greedy_params(4)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    stream = llm.stream(prompt, params)
    next(stream)
    assert llm.reset_prefix_cache() is False
    assert list(stream)
    assert llm.reset_prefix_cache() is True
    (again,) = llm.generate([prompt], params, use_tqdm=False)
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    (cached,) = llm.generate([prompt], params, use_tqdm=False)
    assert cached.num_cached_tokens > 0
    assert llm.get_tokenizer() is llm.tokenizer
    assert_idle(llm)


def test_detokenize_off_leaves_the_text_empty_and_the_tokens_unnamed(text_llm):
    """vLLM's detokenize=False: the same tokens and logprobs, no text anywhere."""
    fields = dict(temperature=1.0, seed=3, max_tokens=12, logprobs=2, prompt_logprobs=1)
    (named,) = text_llm.generate([PROMPT], SamplingParams(**fields), use_tqdm=False)
    plain = SamplingParams(**fields, detokenize=False)
    (output,) = text_llm.generate([PROMPT], plain, use_tqdm=False)

    assert output.token_ids == named.token_ids and named.text and output.text == ""
    for entries, named_entries in zip(
        list(output.outputs[0].logprobs) + output.prompt_logprobs[1:],
        list(named.outputs[0].logprobs) + named.prompt_logprobs[1:],
        strict=True,
    ):
        assert entries == {i: e._replace(decoded_token=None) for i, e in named_entries.items()}
    assert joined(text_llm.stream(PROMPT, plain)) == ("", output.token_ids)
    with pytest.raises(ValueError, match=r"SamplingParams\.stop needs detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    assert_idle(text_llm)


def test_stream_holds_back_a_stop_string(text_llm):
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    (full,) = text_llm.generate([PROMPT], seeded, use_tqdm=False)
    stop = full.text[len(full.text) // 2 :][:6]
    stopped = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, stop=[stop])

    texts = []
    for delta in text_llm.stream(PROMPT, stopped):
        texts.append(delta.text)
        # No partial stop string is ever shown.
        assert stop not in "".join(texts)
    assert "".join(texts) == full.text[: full.text.index(stop)]


def test_interleaved_streams_and_generate(text_llm):
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=n) for seed, n in [(1, 8), (2, 14)]
    ]
    expected = text_llm.generate([PROMPT, "Hello"], params, use_tqdm=False)

    first, second = text_llm.stream(PROMPT, params[0]), text_llm.stream("Hello", params[1])
    deltas = [next(first), next(second)]
    # A generate call in between runs the streams' requests too and keeps their outputs.
    (middle,) = text_llm.generate(["Paris"], greedy_params(5), use_tqdm=False)
    streamed = [joined([deltas[0], *first]), joined([deltas[1], *second])]

    assert streamed == [(o.text, o.token_ids) for o in expected]
    assert len(middle.token_ids) == 5
    assert_idle(text_llm)


def test_closing_a_stream_aborts_its_request(text_llm):
    stream = text_llm.stream(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    assert text_llm.engine.has_unfinished()
    stream.close()
    assert_idle(text_llm)
    # A stream never started queues nothing.
    text_llm.stream(PROMPT)
    assert_idle(text_llm)
    # A stream whose request is aborted from outside ends with an error, never hangs.
    stream = text_llm.stream(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    (request_id,) = text_llm.engine._requests
    text_llm.engine.abort(request_id)
    with pytest.raises(RuntimeError, match="was aborted"):
        next(stream)
    assert_idle(text_llm)


def test_prompt_forms(llm):
    tokens = [5, 6, 7, 8]
    params = greedy_params(3)
    expected = llm.generate([tokens], params, use_tqdm=False)[0].token_ids
    forms = [tokens, np.array(tokens), [np.array(tokens)], (t for t in [tokens]), [tuple(tokens)]]
    for form in forms:
        outputs = llm.generate(form, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == [expected]
    assert llm.generate([], params, use_tqdm=False) == []
    (text_output,) = llm.generate("\x05\x06", params, use_tqdm=False)
    assert text_output.prompt == "\x05\x06"
    assert text_output.prompt_token_ids == llm.tokenizer.encode("\x05\x06")
    # A TokensPrompt's text is the output's prompt; its ids are what runs.
    (tokens_output,) = llm.generate({"prompt": "5 6 7 8", "prompt_token_ids": tokens}, params)
    assert (tokens_output.prompt, tokens_output.prompt_token_ids) == ("5 6 7 8", tokens)
    assert tokens_output.outputs[0].token_ids == expected


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, text_llm):
    tokens = list(range(3, 43))
    params = greedy_params(4)
    (whole,) = llm.generate([tokens[-8:]], params, use_tqdm=False)

    (output,) = llm.generate([tokens], greedy_params(4, truncate_prompt_tokens=8))

    assert output.prompt_token_ids == tokens[-8:]
    assert output.token_ids == whole.token_ids
    # -1: as many as max_model_len leaves room for one token after.
    limit = llm.engine.scheduler.config.max_model_len
    long_prompt = list(np.arange(limit + 30) % 200 + 3)
    (longest,) = llm.generate([long_prompt], greedy_params(4, truncate_prompt_tokens=-1))
    assert longest.prompt_token_ids == long_prompt[-(limit - 1) :]
    assert len(longest.token_ids) == 1
    # A text prompt is truncated after tokenizing; the output keeps the text.
    text = "The capital of France is Paris, and the capital of Italy is"
    ids = text_llm.tokenizer.encode(text)
    (truncated,) = text_llm.generate(text, greedy_params(3, truncate_prompt_tokens=5))
    assert (truncated.prompt, truncated.prompt_token_ids) == (text, ids[-5:])


def test_truncate_prompt_tokens_above_max_model_len_is_refused_before_any_work(llm):
    limit = llm.engine.scheduler.config.max_model_len
    params = [greedy_params(2), greedy_params(2, truncate_prompt_tokens=limit + 1)]
    with pytest.raises(ValueError, match=rf"prompt 1: .*truncate_prompt_tokens={limit + 1} "):
        llm.generate([[5, 6], [7, 8]], params, use_tqdm=False)
    assert_idle(llm)
    (output,) = llm.generate([[7, 8]], greedy_params(2, truncate_prompt_tokens=limit))
    assert output.prompt_token_ids == [7, 8]


def test_save_round_trip(llm, greedy_prompts, greedy_reference, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    llm.save("~/saved")
    assert (tmp_path / "saved").is_dir()

    loaded = LLM(Path("~/saved"), **BASE_SETTINGS)  # "~" and a path object work too

    assert loaded.model_config == llm.model_config
    assert loaded.engine.scheduler.config == llm.engine.scheduler.config
    outputs = loaded.generate(greedy_prompts[:6], greedy_params(), use_tqdm=False)
    assert [o.token_ids for o in outputs] == greedy_reference[:6]
    assert loaded.tokenizer.encode(PROMPT) == llm.tokenizer.encode(PROMPT)
    assert loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    ) == llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )


def test_one_call_generate_builds_one_engine_for_threads_at_once(monkeypatch):
    """Threads asking for the same model share one engine, built once; a thread asking for
    another gets its own model's, built when no other engine runs."""
    built, running, built_while_running = [], [], []

    class SlowLLM:  # builds and generates slowly; generates its model's name
        def __init__(self, model, **kwargs):
            built_while_running.extend(running)
            time.sleep(0.2)
            self.model = model
            built.append(model)

        def generate(self, prompts, sampling_params, use_tqdm):
            running.append(self.model)
            time.sleep(0.05)
            running.remove(self.model)
            return self.model

    monkeypatch.setattr(jaxllm.notebook, "LLM", SlowLLM)
    monkeypatch.setattr(jaxllm.notebook, "check_model", lambda model: None)
    monkeypatch.setattr(jaxllm.notebook, "check_settings", lambda model, config, platform: None)
    monkeypatch.setattr(jaxllm.notebook, "_shared", [])

    def run(models: list[str]) -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
            return list(pool.map(lambda model: jaxllm.generate("x", model=model), models))

    assert run(["random:a"] * 4) == ["random:a"] * 4
    assert built == ["random:a"]
    models = ["random:b", "random:c", "random:b", "random:c"]
    assert run(models) == models
    assert not built_while_running


def test_one_call_generate_reuses_its_engine(checkpoint, llm, tmp_path):
    settings = BASE_SETTINGS | {"max_num_seqs": 4}
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)
    try:
        first = jaxllm.generate([[1, 2, 3]], params, model=str(checkpoint.path), **settings)
        engine = jaxllm.notebook._shared[0][1]
        second = jaxllm.generate([[1, 2, 3]], params, model=str(checkpoint.path), **settings)
        assert jaxllm.notebook._shared[0][1] is engine
        assert engine.engine.stats.prefill.steps == 2
        assert first[0].token_ids == second[0].token_ids
        assert len(first[0].token_ids) == 6
        # An LLM passed as the model is used as it is.
        steps = llm.engine.stats.prefill.steps
        jaxllm.generate([[1, 2, 3]], params, model=llm, use_tqdm=False)
        assert llm.engine.stats.prefill.steps == steps + 1
        assert jaxllm.notebook._shared[0][1] is engine
        with pytest.raises(TypeError, match="engine arguments \\(max_num_seqs\\) with an LLM"):
            jaxllm.generate([[1, 2, 3]], params, model=llm, max_num_seqs=2)
        # Arguments refused before the engine built before is dropped.
        for bad in ({"max_num_seq": 4}, {"max_num_seqs": 0}):
            with pytest.raises((TypeError, ValueError), match="max_num_seq"):
                jaxllm.generate([[1, 2, 3]], params, model=str(checkpoint.path), **bad)
            assert jaxllm.notebook._shared[0][1] is engine
        # ... and those refused against the model or the devices, the default model's too.
        for model, bad, error in (
            (str(checkpoint.path), {"max_model_len": 10**6}, "max_position_embeddings"),
            (None, {"max_model_len": 10**6}, "max_position_embeddings"),
            (str(checkpoint.path), {"tensor_parallel_size": 8}, "tensor_parallel_size=8 "),
            (str(checkpoint.path), {"num_kvcache_blocks": 1}, "less than one request"),
        ):
            with pytest.raises(ValueError, match=error):
                jaxllm.generate([[1, 2, 3]], params, model=model, **bad)
            assert jaxllm.notebook._shared[0][1] is engine
        with pytest.raises(FileNotFoundError, match="does not exist"):  # a mistyped path
            jaxllm.generate([[1, 2, 3]], params, model=str(checkpoint.path / "x"), **settings)
        assert jaxllm.notebook._shared[0][1] is engine
        # A mistyped preset, a directory that holds no checkpoint.
        for model, error in (("random:qwen3-tinyy", "unknown preset"), (tmp_path, "neither")):
            with pytest.raises(ValueError, match=error):
                jaxllm.generate([[1, 2, 3]], params, model=model, **settings)
            assert jaxllm.notebook._shared[0][1] is engine
        # The same directory by another path: the same engine.
        another_path = checkpoint.path / ".." / checkpoint.path.name
        jaxllm.generate([[1, 2, 3]], params, model=another_path, **settings)
        assert jaxllm.notebook._shared[0][1] is engine
        # A policy instance serves one LLM: refused for another before the shared one is dropped.
        policy = LRUPolicy()
        kwargs = dict(model=str(checkpoint.path), eviction_policy=policy, **settings)
        jaxllm.generate([[1, 2, 3]], params, **kwargs)
        engine = jaxllm.notebook._shared[0][1]
        with pytest.raises(ValueError, match="LRUPolicy instance already serves another LLM"):
            jaxllm.generate([[1, 2, 3]], params, **(kwargs | {"max_num_seqs": 2}))
        assert jaxllm.notebook._shared[0][1] is engine
        jaxllm.generate([[1, 2, 3]], params, **kwargs)  # the same arguments: the same engine
        assert jaxllm.notebook._shared[0][1] is engine
        # LLM.generate's name of the sampling params
        third = jaxllm.generate(
            [[1, 2, 3]], sampling_params=params, model=str(checkpoint.path), **settings
        )
        assert third[0].token_ids == first[0].token_ids
    finally:
        jaxllm.notebook._shared.clear()


def test_one_call_generate_checks_a_new_engine_against_memory_in_all(checkpoint, monkeypatch):
    """`jaxllm.generate` checks a new engine's settings before it drops the shared one, whose
    KV cache fills most of a GPU: what they check must not depend on what is free now; the
    new engine checks that once the old one is gone."""
    monkeypatch.setattr(checkpoint_module, "available_memory_bytes", lambda device=None: 0)
    platform = Platform.detect()
    startup.check_settings(
        *engine_settings(str(checkpoint.path), BASE_SETTINGS, platform), platform
    )
    with pytest.raises(ValueError, match=r"the params \(2 layers .* GB available"):
        LLM(checkpoint.path, **BASE_SETTINGS)


def test_one_call_generate_with_the_embedded_default():
    try:
        (output,) = jaxllm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        llm = jaxllm.notebook._shared[0][1]
        assert llm.model == "random:qwen3-tiny"
        # The CPU defaults: a small ladder, compiled as requests need it.
        assert (llm.config.max_num_seqs, llm.config.compile_at_startup) == (16, False)
        assert llm.num_executables <= 4
        assert len(output.token_ids) == 2
    finally:
        jaxllm.notebook._shared.clear()


@pytest.mark.parametrize("kind", ["hugging face", "orbax"])
def test_a_broken_checkpoint_is_refused_before_anything_compiles(
    kind, checkpoint, tmp_path, monkeypatch
):
    # the weights load beside the compile: their checks come first
    broken = Path(shutil.copytree(checkpoint.path, tmp_path / "hf"))
    if kind == "hugging face":
        config = json.loads((broken / "config.json").read_text())
        wider = {"intermediate_size": 2 * config["intermediate_size"]}
        (broken / "config.json").write_text(json.dumps(config | wider))
        expected = r"tensor model\.layers\.0\.mlp\.up_proj\.weight has shape"
    else:
        LLM(checkpoint.path, **BASE_SETTINGS).save(tmp_path / "orbax")
        broken = tmp_path / "orbax"
        manifest = json.loads((broken / MANIFEST_FILE).read_text())
        manifest["leaves"]["final_norm/scale"]["shape"] = [1]
        (broken / MANIFEST_FILE).write_text(json.dumps(manifest))
        expected = r"final_norm/scale: shape \[\d+\], saved as \[1\]"

    def compile_ladder(self, buckets):
        raise AssertionError("compiled before the checkpoint was checked")

    monkeypatch.setattr(ModelRunner, "compile_ladder", compile_ladder)
    with pytest.raises(CheckpointError, match=expected):
        LLM(str(broken), **COMPILED_AT_STARTUP)


def test_startup_phases_account_for_the_compile(checkpoint, monkeypatch):
    # the weights load while the ladder compiles: held until its compile starts
    compiling, held = threading.Event(), []
    compile_ladder, load_params = ModelRunner.compile_ladder, startup.load_params

    def compile_ladder_and_tell(self, buckets):
        compiling.set()
        compile_ladder(self, buckets)

    def load_params_once_compiling(*args, **kwargs):
        held.append(compiling.wait(timeout=120))
        return load_params(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "compile_ladder", compile_ladder_and_tell)
    monkeypatch.setattr(startup, "load_params", load_params_once_compiling)
    start = time.perf_counter()
    llm = LLM(checkpoint.path, **COMPILED_AT_STARTUP)
    elapsed = time.perf_counter() - start

    assert held == [True]

    phases = llm.startup_seconds
    # the weights and the tokenizer load while the programs compile
    assert list(phases) == [
        "size the KV cache",
        "compile",
        "load weights",
        "load the tokenizer",
        "allocate the KV cache",
        "warm up",
    ]
    assert llm.compile_seconds == phases["compile"] > 0
    assert sum(phases.values()) <= elapsed
    assert llm.num_executables > 0 and llm.num_compilations_since_startup == 0
    assert llm.kernels.decode == "reference"  # the CPU's default


def test_warm_up_runs_every_executable_once_and_writes_nothing(checkpoint):
    llm = LLM(checkpoint.path, **COMPILED_AT_STARTUP)
    runner = llm.engine.runner
    runs = []

    def counted(key, executable):
        def run(*args):
            runs.append(key)
            return executable(*args)

        return run

    for executables in (runner._forward_executables, runner._sample_executables):
        for key, executable in executables.items():
            executables[key] = counted(key, executable)

    runner.warm_up()  # again: start-up ran it once already

    assert sorted(map(str, runs)) == sorted(
        map(str, [*runner._forward_executables, *runner._sample_executables])
    )
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(runner.kv_cache))
    prompt = [5, 6, 7, 8, 9]
    (output,) = llm.generate([prompt], greedy_params(8), use_tqdm=False)
    assert output.token_ids == checkpoint.greedy(prompt, 8)
    assert llm.num_compilations_since_startup == 0


def test_other_sampler_variants_and_logprobs_compile_for_the_whole_ladder_on_first_use(
    checkpoint,
):
    settings = COMPILED_AT_STARTUP | {"num_scheduler_steps": 4}
    llm = LLM(checkpoint.path, **settings)
    runner = llm.engine.runner
    rows = {bucket.num_sampled for bucket in runner.ladder if bucket.num_steps == 1}
    several = {bucket for bucket in runner.ladder if bucket.num_steps > 1}
    assert several and {mode for _, mode in runner._sample_executables} == {"greedy", "random"}
    assert not runner._logprob_executables
    top_k = SamplingParams(temperature=1.0, top_k=5, seed=4, max_tokens=12, ignore_eos=True)
    # one step a plan (logprobs): top-k samplers and logprobs for every bucket of the ladder
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    (first,) = llm.generate(prompts[:1], dataclasses.replace(top_k, logprobs=2), use_tqdm=False)
    compiled = llm.num_compilations_since_startup
    assert {n for n, mode in runner._sample_executables if mode == "top-k"} == rows
    assert set(runner._logprob_executables) == rows
    assert {
        bucket for bucket, mode, _ in runner._multi_step_executables if mode == "top-k"
    } == several
    # several steps a plan, and more rows: compiled already
    second = llm.generate(prompts, top_k, use_tqdm=False)
    assert llm.num_compilations_since_startup == compiled
    assert second[0].outputs[0].token_ids == first.outputs[0].token_ids
    # the tokens of an engine that compiles each step's programs as it first needs them
    lazy = LLM(checkpoint.path, **settings | {"compile_at_startup": False})
    assert lazy.generate(prompts[:1], top_k, use_tqdm=False)[0].outputs == second[0].outputs


def test_a_dropped_llm_is_freed_with_what_was_alive_when_it_ran(checkpoint):
    """`del llm` frees the engine (its KV cache and weights), and the objects in reference
    cycles that were alive while it ran: a notebook re-running `llm = LLM(...)` holds one."""

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    cycle = Cycle()
    llm = LLM(str(checkpoint.path), **BASE_SETTINGS)
    llm.generate([[1, 2, 3]], greedy_params(2), use_tqdm=False)
    engine, cycle_ref = weakref.ref(llm.engine), weakref.ref(cycle)
    del llm, cycle
    gc.collect()
    assert engine() is None and cycle_ref() is None


def test_an_interrupt_as_the_progress_bar_closes_leaves_the_collector_unfrozen(llm, monkeypatch):
    class InterruptedBar(jaxllm.llm.tqdm):
        def close(self) -> None:
            if not getattr(self, "interrupted", False):  # once: its __del__ closes it again
                self.interrupted = True
                _thread.interrupt_main()  # Ctrl-C as the call ends
                time.sleep(0.01)
            super().close()

    monkeypatch.setattr(jaxllm.llm, "tqdm", InterruptedBar)
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3]], greedy_params(2), use_tqdm=False)
    assert gc.get_freeze_count() == 0
    assert_idle(llm)


def test_a_refused_call_leaves_the_seeds_of_unseeded_requests_as_they_were(
    checkpoint, greedy_prompts
):
    # a notebook cell run again once its typo is fixed samples what a fresh LLM would
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    used, fresh = (LLM(str(checkpoint.path), **BASE_SETTINGS) for _ in range(2))
    with pytest.raises(ValueError, match="prompt 1"):
        used.generate([greedy_prompts[0], [10**9]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="takes one prompt"):
        used.stream(greedy_prompts[:2], params)
    outputs = used.generate(greedy_prompts[:2], params, use_tqdm=False)
    expected = fresh.generate(greedy_prompts[:2], params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_objects_the_caller_froze_stay_frozen(llm):
    gc.freeze()  # as a server does before it forks
    try:
        frozen = gc.get_freeze_count()
        llm.generate([[1, 2, 3]], greedy_params(2), use_tqdm=False)
        assert gc.get_freeze_count() > frozen - 100  # less only those that died, not 0
    finally:
        gc.unfreeze()


def test_the_progress_bar_ends_on_the_last_step_that_ran(llm, capsys):
    llm.generate([[1, 2, 3], [4, 5]], greedy_params(6), use_tqdm=True)
    last = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert "2/2" in last and re.search(r"(Prefill|Decode): [1-9][\d,]*tok/s", last), last
