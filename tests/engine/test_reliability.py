"""What jaxllm promises when things go wrong (docs/reliability.md): Ctrl-C at any moment, calls
from two threads, a step that fails on the device, saving over a user's files, sizes that cannot
fit, and a quick start on a CPU."""

from __future__ import annotations

import _thread
import threading
import time

import jax
import numpy as np
import pytest
from support.engine import BASE_SETTINGS, assert_idle, greedy_params

from jaxllm import LLM

NUM_PROMPTS = 4  # of the greedy batch, checked after every interrupt


def interrupted(call, delay: float):
    """`call()`, with a KeyboardInterrupt sent to the main thread after `delay` seconds, as
    Ctrl-C would; its result, or None if the interrupt stopped it."""
    timer = threading.Timer(delay, _thread.interrupt_main)
    try:
        timer.start()
        try:
            result = call()
        finally:
            timer.cancel()
            timer.join()
        time.sleep(0.01)  # an interrupt sent just as the call returned lands here
        return result
    except KeyboardInterrupt:
        return None


def assert_serves_the_reference(llm: LLM, prompts, reference) -> None:
    assert not llm._finished
    assert_idle(llm)
    outputs = llm.generate(prompts, greedy_params(), use_tqdm=False)
    assert [output.token_ids for output in outputs] == reference


@pytest.mark.parametrize("entry", ["generate", "stream"])
def test_interrupt_at_random_moments(entry, make_llm, greedy_prompts, greedy_reference):
    llm = make_llm(max_num_seqs=4)
    prompts, reference = greedy_prompts[:NUM_PROMPTS], greedy_reference[:NUM_PROMPTS]
    if entry == "generate":
        call = lambda: llm.generate(prompts, greedy_params(), use_tqdm=False)
    else:
        call = lambda: [list(llm.stream(prompt, greedy_params())) for prompt in prompts]
    call()  # compiles the buckets, so that the timed calls below are the steady ones
    start = time.perf_counter()
    call()
    duration = time.perf_counter() - start
    rng = np.random.default_rng(0)
    num_interrupted = 0
    # NOTE: within the first 60% of a call, so that a call running faster than the timed one
    # (a busy machine's timing) is still interrupted mostly.
    for delay in rng.uniform(0, 0.6 * duration, 16):
        num_interrupted += interrupted(call, delay) is None
        assert llm.engine.runner.kv_cache is not None
        assert_serves_the_reference(llm, prompts, reference)
    assert num_interrupted >= 8


def test_interrupt_inside_a_step_is_held_until_the_step_ends(
    make_llm, greedy_prompts, greedy_reference
):
    llm = make_llm(max_num_seqs=4)
    stream = llm.stream(greedy_prompts[6], greedy_params())
    first = next(stream)
    runner = llm.engine.runner
    execute = runner.execute

    def interrupting_execute(plan, *masks):
        runner.execute = execute
        _thread.interrupt_main()  # arrives while the step runs
        time.sleep(0.01)
        return execute(plan, *masks)

    runner.execute = interrupting_execute
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(greedy_prompts[7], greedy_params(), use_tqdm=False)
    finally:
        vars(runner).pop("execute", None)
    # The step ran whole: only the interrupted call's request ended, the stream goes on.
    rest = [t for delta in stream for t in delta.token_ids]
    assert first.token_ids + rest == greedy_reference[6]
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(runner.kv_cache))
    assert_idle(llm)


@pytest.mark.parametrize("entry", ["generate", "stream"])
def test_an_interrupt_while_requests_are_queued_leaves_none_half_queued(
    entry, make_llm, greedy_prompts, greedy_reference
):
    llm = make_llm(max_num_seqs=4)
    scheduler = llm.engine.scheduler

    class InterruptedOnce(dict):
        def __setitem__(self, seq_id, seq):
            scheduler._live = dict(self)
            _thread.interrupt_main()  # arrives between the scheduler's queue and its live set
            time.sleep(0.01)
            scheduler._live[seq_id] = seq

    scheduler._live = InterruptedOnce(scheduler._live)
    try:
        with pytest.raises(KeyboardInterrupt):
            if entry == "generate":
                llm.generate(greedy_prompts[:2], greedy_params(), use_tqdm=False)
            else:
                next(llm.stream(greedy_prompts[0], greedy_params()))
    finally:
        scheduler._live = dict(scheduler._live)
    assert_serves_the_reference(llm, greedy_prompts[:NUM_PROMPTS], greedy_reference[:NUM_PROMPTS])


def test_a_second_interrupt_while_a_call_aborts_its_requests_leaves_none_running(
    make_llm, greedy_prompts, greedy_reference
):
    llm = make_llm(max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    execute, abort = runner.execute, engine.abort

    def interrupted_execute(plan, *masks):
        runner.execute = execute
        _thread.interrupt_main()  # the first Ctrl-C: raised as the step ends
        time.sleep(0.01)
        return execute(plan, *masks)

    def interrupted_abort(request_id):
        engine.abort = abort
        _thread.interrupt_main()  # the second, while the requests are aborted
        time.sleep(0.01)
        return abort(request_id)

    runner.execute, engine.abort = interrupted_execute, interrupted_abort
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(greedy_prompts[:4], greedy_params(), use_tqdm=False)
    finally:
        vars(runner).pop("execute", None)
        vars(engine).pop("abort", None)
    assert_idle(llm)
    (output,) = llm.generate(greedy_prompts[4], greedy_params(), use_tqdm=False)
    assert output.outputs[0].token_ids == greedy_reference[4]


def test_a_stream_closed_inside_a_step_is_aborted_after_it(
    make_llm, greedy_prompts, greedy_reference
):
    """The collector closes a dropped stream wherever it runs: inside a step of another call,
    its request is aborted once that step ends, and the others go on."""
    llm = make_llm(max_num_seqs=4)
    dropped = llm.stream(greedy_prompts[5], greedy_params())
    kept = llm.stream(greedy_prompts[6], greedy_params())
    first = next(kept)
    next(dropped)
    dropped_id = min(llm.engine._requests)  # made first
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def closing_schedule():
        scheduler.schedule = schedule
        dropped.close()  # as the collector would, mid-step
        assert llm.engine.has_request(dropped_id)  # not aborted yet
        return schedule()

    scheduler.schedule = closing_schedule
    try:
        rest = [t for delta in kept for t in delta.token_ids]
    finally:
        vars(scheduler).pop("schedule", None)
    assert first.token_ids + rest == greedy_reference[6]
    assert_idle(llm)


def test_a_stream_closed_while_another_thread_runs_the_engine_never_waits(
    make_llm, greedy_prompts, greedy_reference
):
    """Closed in a thread the lock's holder waits for (a compilation's), a stream does not
    wait for the lock: its request is aborted by the next call."""
    llm = make_llm(max_num_seqs=4)
    stream = llm.stream(greedy_prompts[5], greedy_params())
    next(stream)
    with llm._lock:  # another call runs the engine
        closer = threading.Thread(target=stream.close)
        closer.start()
        closer.join(timeout=30)
        assert not closer.is_alive()
        assert llm.engine.has_unfinished()
    (output,) = llm.generate(greedy_prompts[6], greedy_params(), use_tqdm=False)
    assert output.outputs[0].token_ids == greedy_reference[6]
    assert_idle(llm)


def test_a_plan_made_ahead_and_dropped_leaves_no_unwritten_block_cached(
    llm, greedy_prompts, greedy_reference
):
    """A constrained step plans the next one while its masks fill (`Engine._masks`); a Ctrl-C
    then aborts the call with that plan made, its prompt blocks entered in the prefix cache but
    never written. A refused `update_params`, which drops the plan, must not leave them there."""
    engine, prompt = llm.engine, greedy_prompts[-1]
    engine.add(engine.new_request(prompt, greedy_params()))
    engine._next_plan = engine.scheduler.schedule()  # as `_masks` plans, never run
    assert engine._next_plan.is_prefill
    engine.abort(max(engine._requests))
    with pytest.raises(ValueError):
        llm.update_params({"not": "weights"})

    (output,) = llm.generate([prompt], greedy_params(), use_tqdm=False)

    assert output.token_ids == greedy_reference[-1]
    assert_idle(llm)


def test_a_failed_step_resets_the_engine(make_llm, greedy_prompts, greedy_reference):
    llm = make_llm(max_num_seqs=4)
    prompts, reference = greedy_prompts[:NUM_PROMPTS], greedy_reference[:NUM_PROMPTS]
    llm.generate(prompts, greedy_params(), use_tqdm=False)  # fills the prefix cache
    runner = llm.engine.runner

    def failing_execute(plan, *masks):  # as a device error after the cache was donated
        jax.tree.map(lambda leaf: leaf.delete(), runner.kv_cache)
        raise RuntimeError("device failure")

    runner.execute = failing_execute
    try:
        with pytest.raises(RuntimeError, match="device failure"):
            llm.generate(prompts, greedy_params(), use_tqdm=False)
    finally:
        del runner.execute
    assert llm.cache_stats().num_cached_free_blocks == 0  # its KV was lost with the cache
    assert_serves_the_reference(llm, prompts, reference)


def test_an_eviction_policy_that_raises_leaves_a_fresh_engine(
    checkpoint, greedy_prompts, greedy_reference
):
    """A user's policy that raises in the step and again as the engine resets: the step's error
    is raised, the pool and the device are reset all the same, and nothing cached of the failed
    step (its KV never written) serves a later request."""
    from jaxllm.cache.eviction import PriorityPolicy

    class TierPolicy(PriorityPolicy):
        def priority(self, block_id):
            return self.info(block_id).metadata["tier"]  # KeyError without extra_args

    llm = LLM(str(checkpoint.path), **(BASE_SETTINGS | {"eviction_policy": TierPolicy()}))
    prompts, reference = greedy_prompts[3:5], greedy_reference[3:5]  # 16, 17 tokens: cached
    with pytest.raises(KeyError, match="tier") as raised:
        llm.generate(prompts, greedy_params(1), use_tqdm=False)
    assert "resetting the engine raised too" in "".join(raised.value.__notes__)
    assert_idle(llm)
    tiered = greedy_params(extra_args={"tier": 1})
    outputs = llm.generate(prompts, tiered, use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == reference
    assert_idle(llm)


def test_two_threads_share_one_llm(make_llm, greedy_prompts, greedy_reference):
    llm = make_llm(max_num_seqs=4)
    results: dict[str, object] = {}

    def run(name, call):
        try:
            results[name] = call()
        except BaseException as error:
            results[name] = error

    generate = lambda prompts: llm.generate(prompts, greedy_params(), use_tqdm=False)
    stream = lambda prompt: [t for d in llm.stream(prompt, greedy_params()) for t in d.token_ids]
    threads = [
        threading.Thread(target=run, args=("a", lambda: generate(greedy_prompts[:3]))),
        threading.Thread(target=run, args=("b", lambda: generate(greedy_prompts[3:6]))),
        threading.Thread(target=run, args=("c", lambda: stream(greedy_prompts[6]))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [o.token_ids for o in results["a"]] == greedy_reference[:3]
    assert [o.token_ids for o in results["b"]] == greedy_reference[3:6]
    assert results["c"] == greedy_reference[6]
    assert_idle(llm)


def test_save_never_overwrites_a_users_files(llm, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "generation_config.json").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        llm.save(target)
    assert [p.name for p in target.iterdir()] == ["generation_config.json"]
    assert (target / "generation_config.json").read_text() == "mine"

    (target / "notes.txt").write_text("keep")
    llm.save(target, overwrite=True)
    assert (target / "notes.txt").read_text() == "keep"
    assert (target / "generation_config.json").read_text() != "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left
    for path in (target / "notes.txt", target / "notes.txt" / "model"):
        with pytest.raises(ValueError, match=r"notes\.txt exists and is not a directory"):
            llm.save(path)


def test_empty_model_name_is_refused():
    with pytest.raises(ValueError, match="model is an empty string"):
        LLM("")
    with pytest.raises(TypeError, match="model must be a path"):
        LLM(3)


def test_max_model_len_beyond_the_models_positions(checkpoint):
    settings = BASE_SETTINGS | {"max_model_len": 1024}  # the checkpoint has 512 positions
    with pytest.raises(ValueError, match="max_model_len=1024 is more than the model's"):
        LLM(checkpoint.path, **settings)


def test_a_kv_cache_that_cannot_fit_is_refused_before_allocating(checkpoint):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"the KV cache \(\d+ blocks .* GB available"):
        LLM(checkpoint.path, **BASE_SETTINGS | {"num_kvcache_blocks": 2**31 - 1})
    assert time.perf_counter() - start < 30  # refused, not attempted


def test_a_max_num_seqs_whose_token_bitmasks_cannot_fit_is_refused_by_name(checkpoint):
    """Below the KV cache lies a token bitmask of each row a step may sample (vocab / 32
    words): 2^31 - 1 rows of 256 tokens take 69 GB, once a numpy MemoryError at allocation."""
    settings = BASE_SETTINGS | {"max_num_seqs": 2**31 - 1}
    with pytest.raises(ValueError, match=r"max_num_seqs=2147483647\).* GB available"):
        LLM(checkpoint.path, **settings)


def test_a_cpu_compiles_buckets_as_steps_need_them(checkpoint, greedy_prompts, greedy_reference):
    llm = LLM(checkpoint.path)  # the defaults: the model's 512 positions, the whole ladder
    assert llm.num_executables == 0 and llm.config.max_model_len == 512
    output = llm.generate(greedy_prompts[2], greedy_params(8), use_tqdm=False)[0]
    assert output.token_ids == greedy_reference[2][:8]
    assert 0 < llm.num_executables <= 4
