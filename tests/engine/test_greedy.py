"""Greedy outputs of the engine equal transformers' greedy `generate`, token for token, whatever
the scheduler does: prefix caching on or off, chunked prefill, preemption; and prefix hits
change nothing."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from support.engine import (
    BASE_SETTINGS,
    BLOCK_SIZE,
    NUM_GREEDY_TOKENS,
    assert_idle,
    gpu_kernel_settings,
    greedy_params,
    make_llm_with,
)
from support.hf import VOCAB_SIZE

from jaxllm.steps import FixedInputs, packed_size, settings_size

# name -> engine settings over BASE_SETTINGS
SCHEDULES = {
    "prefix-caching": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    # Chunks of 48 tokens (the CPU's tiles of 16): chunk ends fall inside blocks of 32.
    "chunked-prefill": {"max_num_batched_tokens": 48, "kvcache_block_size": 32},
    # 32 blocks of 16 tokens: one max_model_len request, far less than the batch needs; MRU
    # eviction, unlike the default LRU, drops the blocks just freed by preemption first.
    "preemption": {"num_kvcache_blocks": 32, "eviction_policy": "mru"},
    # Decode through jaxllm's Pallas kernels (interpreted on a CPU): attention, and the q/k
    # norms, rotary embedding and cache write.
    "pallas-decode": {"attention": "pallas"},
    # Plans of 5 decode steps once nothing waits: outputs end mid-plan (24 = 4 x 5 + 4).
    "multi-step": {"num_scheduler_steps": 5},
    "multi-step-preemption": {"num_scheduler_steps": 5, "num_kvcache_blocks": 32},
    "multi-step-pallas-decode": {"num_scheduler_steps": 5, "attention": "pallas"},
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_equals_transformers(schedule, make_llm, greedy_prompts, greedy_reference):
    llm = make_llm(**SCHEDULES[schedule])
    preemptions = llm.engine.scheduler.num_preemptions
    outputs = llm.generate(greedy_prompts, greedy_params(), use_tqdm=False)

    for prompt, output, expected in zip(greedy_prompts, outputs, greedy_reference, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert output.finish_reason == "length"
    if schedule.endswith("preemption"):
        assert llm.engine.scheduler.num_preemptions > preemptions
    if schedule.startswith("multi-step"):
        assert llm.engine.stats.decode.tokens > 2 * llm.engine.stats.decode.steps
    if schedule == "chunked-prefill":
        assert llm.engine.stats.prefill.steps > sum(len(p) for p in greedy_prompts) // 48
    assert_idle(llm)


def test_decode_steps_on_padding_rows_equal_transformers(
    checkpoint, greedy_prompts, greedy_reference
):
    """Decode steps of fewer rows than the kernels' `decode_rows` (8 on an NVIDIA GPU) run their
    layers on padding rows up to it: the same tokens."""
    with gpu_kernel_settings(decode_rows=8):
        llm = make_llm_with(checkpoint.path, **BASE_SETTINGS)
    assert llm.engine.runner.kernels.decode_rows == 8

    outputs = llm.generate(greedy_prompts[:3], greedy_params(), use_tqdm=False)  # 1 - 3 rows

    assert [output.token_ids for output in outputs] == greedy_reference[:3]
    assert_idle(llm)


def test_forward_passes_read_their_inputs_from_buffers_of_fixed_addresses(
    checkpoint, greedy_prompts, greedy_reference, monkeypatch
):
    """With the kernels' `fixed_inputs` (on an NVIDIA GPU) a program of their own writes each
    one-step plan's inputs (the forward pass's, the sampler's settings) into buffers of their
    packed sizes, in place: the same tokens, through preemption, and each pair of sizes'
    buffers at one device address."""
    with gpu_kernel_settings(fixed_inputs=True):
        llm = make_llm_with(checkpoint.path, **BASE_SETTINGS, **SCHEDULES["preemption"])
    runner = llm.engine.runner
    sizes = {
        (packed_size(bucket), settings_size(bucket.num_sampled))
        for bucket in runner.ladder
        if bucket.num_steps == 1
    }
    assert set(runner._fixed.executables) == sizes
    addresses = collections.defaultdict(set)
    call = FixedInputs.__call__

    def spying(self, packed, settings, previous_tokens):
        inputs = call(self, packed, settings, previous_tokens)
        addresses[len(packed), len(settings)].add(tuple(x.unsafe_buffer_pointer() for x in inputs))
        for written, given in zip(inputs, (packed, settings, previous_tokens), strict=True):
            np.testing.assert_array_equal(written, given)
        return inputs

    monkeypatch.setattr(FixedInputs, "__call__", spying)
    outputs = llm.generate(greedy_prompts, greedy_params(), use_tqdm=False)

    assert [output.token_ids for output in outputs] == greedy_reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(addresses) > 1 and all(len(seen) == 1 for seen in addresses.values())
    assert_idle(llm)


def test_prefix_hits_change_nothing(make_llm, checkpoint):
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, VOCAB_SIZE, 150).tolist()
    prompts = [prefix + rng.integers(0, VOCAB_SIZE, n).tolist() for n in (1, 5, 16, 30, 41, 2)]
    prompts.append(prefix[:100])  # a prompt inside the shared prefix
    params = greedy_params(16)
    cached_llm = make_llm()
    uncached = make_llm(enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    hits_before = cached_llm.cache_stats().num_hit_tokens

    first = cached_llm.generate(prompts, params, use_tqdm=False)
    second = cached_llm.generate(prompts, params, use_tqdm=False)

    assert [o.num_cached_tokens for o in uncached] == [0] * len(prompts)
    # The first call: later prompts hit the prefix computed for earlier ones.
    assert sum(o.num_cached_tokens > 0 for o in first) >= len(prompts) - 2
    # The second call: every prompt hits its whole blocks but the last token's.
    for prompt, output in zip(prompts, second, strict=True):
        assert output.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    for prompt, a, b, c in zip(prompts, uncached, first, second, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.token_ids == checkpoint.greedy(prompt, 16)
    stats = cached_llm.cache_stats()
    assert stats.num_hit_tokens - hits_before == sum(o.num_cached_tokens for o in first + second)
    assert 0 < stats.hit_rate <= 1
    assert_idle(cached_llm)


def test_max_model_len_caps_every_request(llm, checkpoint):
    rng = np.random.default_rng(2)
    long_prompt = rng.integers(0, VOCAB_SIZE, 500).tolist()
    longest_prompt = rng.integers(0, VOCAB_SIZE, 511).tolist()
    outputs = llm.generate([long_prompt, longest_prompt], greedy_params(100), use_tqdm=False)
    assert [len(o.token_ids) for o in outputs] == [12, 1]
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    assert outputs[0].token_ids == checkpoint.greedy(long_prompt, 12)


def test_metrics_and_item_access(llm, greedy_prompts, greedy_reference):
    (output,) = llm.generate([greedy_prompts[3]], greedy_params(), use_tqdm=False)
    assert output["text"] == output.text
    assert output["token_ids"] == output.token_ids == greedy_reference[3]
    assert output["finish_reason"] == "length"
    with pytest.raises(KeyError):
        output["no such field"]
    assert 0 < output.metrics.time_to_first_token <= output.metrics.total_time
    assert len(output.token_ids) == NUM_GREEDY_TOKENS


def test_multi_step_plans_stop_mid_plan(make_llm, greedy_prompts, greedy_reference):
    llm = make_llm(num_scheduler_steps=5)
    stops = []
    for expected in greedy_reference:  # a token first sampled 8th or later: mid-plan
        index = next(i for i, t in enumerate(expected) if i >= 7 and t not in expected[:i])
        stops.append((expected[index], index))
    params = [greedy_params(stop_token_ids=[token]) for token, _ in stops]
    outputs = llm.generate(greedy_prompts, params, use_tqdm=False)
    for output, expected, (_, index) in zip(outputs, greedy_reference, stops, strict=True):
        assert output.token_ids == expected[: index + 1]
        assert output.finish_reason == "stop"
    assert_idle(llm)


def test_the_host_reads_sampled_tokens_from_host_memory(make_llm, greedy_prompts, monkeypatch):
    """Each step's program writes the tokens the host reads to host memory, one step a plan
    and several alike (the devices keep their own copy for the next step)."""
    llm = make_llm(num_scheduler_steps=5)
    runner, seen = llm.engine.runner, set()
    execute = runner.execute

    def spying(plan, *args):
        result = execute(plan, *args)  # its tokens: what the engine reads
        seen.add((plan.bucket.num_steps, result.tokens.sharding.memory_kind))
        return result

    monkeypatch.setattr(runner, "execute", spying)
    llm.generate(greedy_prompts[:2], greedy_params(), use_tqdm=False)
    assert seen == {(1, "pinned_host"), (5, "pinned_host")}


def test_a_model_of_no_layers_sizes_its_cache_and_equals_transformers(tmp_path):
    """Its KV blocks hold 0 bytes: the cache is sized without dividing by them."""
    from support.engine import BASE_SETTINGS
    from support.hf import save_checkpoint

    from jaxllm import LLM

    checkpoint = save_checkpoint(tmp_path, layers=0)
    llm = LLM(str(checkpoint.path), **BASE_SETTINGS)  # num_kvcache_blocks not given
    prompt = [5, 17, 42]
    (output,) = llm.generate([prompt], greedy_params(6), use_tqdm=False)
    assert output.token_ids == checkpoint.greedy(prompt, 6)
