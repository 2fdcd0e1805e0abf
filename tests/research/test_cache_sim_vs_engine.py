"""The simulator and the engine agree: same workload, same scheduler settings, same prefix-cache
counters, evictions and preemptions, under every eviction policy (those reading the requests'
metadata and refusing blocks too), also when requests arrive over time; and the policy never
changes the generated tokens.

The workload (prefix repetition, a hot prefix with scans, shared prefixes) in a cache of 16
blocks of 16 tokens makes the engine evict and preempt, and gives each policy a different hit
count, so the agreement is not the trivial one of an idle cache.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from support.engine import BASE_SETTINGS

from jaxllm import LLM, SamplingParams
from jaxllm.research import workloads as w
from jaxllm.research.cache_sim import POLICY_NAMES, simulate
from jaxllm.research.policies import PrefixCostPolicy, SessionPolicy

NUM_BLOCKS = 16
# NOTE: the engine's clock is the wall's, the simulator's stands still here: prefix-cost's
# weights must outweigh any wall time for the two to choose alike.
HOOK_POLICIES = {
    "prefix-cost": lambda: PrefixCostPolicy(seconds_per_block=1e9),
    "session": SessionPolicy,
}
ALL_POLICIES = (*POLICY_NAMES, *HOOK_POLICIES)


def make_policy(name: str):
    return HOOK_POLICIES[name]() if name in HOOK_POLICIES else name


def workload() -> list[w.Request]:
    """The requests, two of three in a session, of priority 0 to 2."""
    requests = (
        w.prefix_repetition(24, 6, 32, 4, 6, zipf_exponent=1.0, vocab_size=256, seed=4)
        + w.hot_prefix_with_scans(2, 12, 6, vocab_size=256, seed=4)
        + w.shared_prefix(3, 4, 40, 8, 12, order="interleaved", vocab_size=256, seed=4)
    )
    return [
        dataclasses.replace(r, metadata={"session_id": i % 3 or None, "priority": i % 4 // 2})
        for i, r in enumerate(requests)
    ]


@pytest.fixture(scope="module")
def runs(checkpoint) -> dict:
    """policy -> (the engine's scheduler config, cache stats, preemptions, outputs)."""
    requests = workload()
    prompts = [r.prompt_token_ids.tolist() for r in requests]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, extra_args=r.metadata
        )
        for r in requests
    ]
    results = {}
    for policy in ALL_POLICIES:
        settings = dict(
            max_model_len=256, num_kvcache_blocks=NUM_BLOCKS, eviction_policy=make_policy(policy)
        )
        llm = LLM(str(checkpoint.path), **BASE_SETTINGS | settings)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[policy] = (
            llm.engine.scheduler.config,
            llm.cache_stats(),
            llm.engine.scheduler.num_preemptions,
            outputs,
        )
        del llm
    return results


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_simulator_reports_what_the_engine_did(runs, policy):
    config, stats, preemptions, outputs = runs[policy]
    predicted = simulate(workload(), config, make_policy(policy), check_integrity=True)
    assert predicted.num_queried_tokens == stats.num_queried_tokens
    assert predicted.num_hit_tokens == stats.num_hit_tokens
    assert predicted.num_evictions == stats.num_evictions
    assert predicted.num_preemptions == preemptions
    assert predicted.num_prompt_hit_tokens == sum(o.num_cached_tokens for o in outputs)
    assert stats.num_evictions > 0 and preemptions > 0


def test_policies_differ_on_this_workload(runs):
    hits = {policy: runs[policy][1].num_hit_tokens for policy in POLICY_NAMES}
    assert len(set(hits.values())) == len(POLICY_NAMES), hits


def test_policy_never_changes_the_tokens(runs):
    tokens = {policy: [o.token_ids for o in runs[policy][3]] for policy in ALL_POLICIES}
    reference = tokens["lru"]
    assert all(len(t) == r.max_tokens for t, r in zip(reference, workload(), strict=True))
    for policy in ALL_POLICIES:
        assert tokens[policy] == reference, policy
    # NOTE: not a constant stream: the model's tokens depend on the prompt.
    assert len({tuple(t) for t in reference}) > len(reference) // 2
    assert np.unique(np.concatenate(reference)).size > 4


def test_bench_workload_record_matches_the_simulator(tmp_path):
    """`scripts/bench.py --workload ...` on the CPU: its record's counters are the simulator's."""
    from jaxllm.research.bench import main

    path = tmp_path / "record.json"
    argv = [
        "--workload=shared-prefix",
        "--groups=4",
        "--prompts-per-group=3",
        "--prefix-len=128",
        "--question-len=16",
        "--output-len=8",
        "--order=interleaved",
        "--block-size=16",
        "--num-kvcache-blocks=32",
        "--eviction-policy=mru",
        "--no-compile-at-startup",
        f"--json={path}",
    ]
    assert main(argv) == 0
    record = json.loads(path.read_text())
    assert record["workload"] == "shared-prefix" and record["num_seqs"] == 12
    assert record["eviction_policy"] == "mru" and record["num_kvcache_blocks"] == 32
    assert record["cache_evictions"] > 0 and record["cache_hit_tokens"] > 0
    for engine_name, sim_name in [
        ("cache_hit_tokens", "sim_hit_tokens"),
        ("prompt_hit_tokens", "sim_prompt_hit_tokens"),
        ("cache_evictions", "sim_evictions"),
        ("preemptions", "sim_preemptions"),
    ]:
        assert record[engine_name] == record[sim_name], engine_name
    assert record["prompt_tokens"] == 12 * 144
    assert 0 < record["ttft_ms_p50"] <= record["ttft_ms_p99"]


@pytest.mark.parametrize("policy", ["lru", "session"])
def test_simulator_reports_what_the_engine_did_on_a_timed_trace(checkpoint, policy):
    """Requests arriving over time. In the simulator, with one step a second, a request
    arriving at second t is added before plan t + 1 (plans run one step ahead); the engine gets
    it before its step call t + 1. A long first request keeps both busy until the last arrival,
    so the simulator's clock never jumps ahead."""
    anchor = w.Request(np.arange(1, 9, dtype=np.int32), 120, 0.0, {"session_id": 0})
    timed = [anchor] + [
        dataclasses.replace(r, arrival_time=float(1 + i // 2)) for i, r in enumerate(workload())
    ]
    settings = dict(
        max_model_len=256, num_kvcache_blocks=NUM_BLOCKS, eviction_policy=make_policy(policy)
    )
    llm = LLM(str(checkpoint.path), **BASE_SETTINGS | settings)
    engine, pending, calls = llm.engine, list(timed), 0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_time <= max(calls - 1, 0):
            request = pending.pop(0)
            params = SamplingParams(
                temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True,
                extra_args=request.metadata,
            )  # fmt: skip
            engine.add(engine.new_request(request.prompt_token_ids.tolist(), params))
        engine.step()
        calls += 1
    stats = llm.cache_stats()
    config = engine.scheduler.config
    predicted = simulate(
        timed, config, make_policy(policy), arrival="time", step_time=1.0, check_integrity=True
    )
    assert predicted.num_queried_tokens == stats.num_queried_tokens
    assert predicted.num_hit_tokens == stats.num_hit_tokens > 0
    assert predicted.num_evictions == stats.num_evictions > 0
    assert predicted.num_preemptions == engine.scheduler.num_preemptions
    assert predicted.num_prefill_steps + predicted.num_decode_steps == calls - 1
