"""The simulator: analytic hit counts, the policies told apart, invariants, arrivals, the CLI,
and the new-policy example of docs/cache-policies.md (pure Python + numpy, no model)."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from support.repo import ROOT

from jaxllm.cache import LRUPolicy
from jaxllm.research import workloads as w
from jaxllm.research.cache_sim import (
    POLICY_NAMES,
    blocks_for_all,
    default_cache_sizes,
    make_config,
    simulate,
    sweep,
)
from jaxllm.research.sim_report import format_table
from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, SchedulerConfig

BLOCK = 16


def sequential_config(requests, num_blocks=None, **overrides) -> SchedulerConfig:
    """One request at a time (max_num_seqs=1): each prompt sees every earlier one cached."""
    settings = dict(block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=256, prefill_tile=16)
    return make_config(requests, num_blocks, **settings | overrides)


# Analytic hit counts with a cache that never evicts.


@pytest.mark.parametrize(
    ("prefix_len", "question_len", "hit_per_prompt"),
    [
        (40, 8, 32),  # the hit stops at the last full block of the prefix
        (32, 8, 32),  # a block-aligned prefix is hit whole
        (32, 0, 16),  # identical prompts: the last token is computed, so its block is too
        (15, 8, 0),  # a prefix shorter than a block is never hit
    ],
)
def test_shared_prefix_hits_with_unlimited_cache(prefix_len, question_len, hit_per_prompt):
    groups, per_group = 3, 5
    requests = w.shared_prefix(groups, per_group, prefix_len, question_len, 4, seed=0)
    result = simulate(requests, sequential_config(requests), check_integrity=True)
    # hits = groups x (prompts per group - 1) x the prefix's full blocks, but a hit covers at
    # most (num_tokens - 1) // block_size blocks
    num_tokens = prefix_len + question_len
    assert hit_per_prompt == min(prefix_len // BLOCK, (num_tokens - 1) // BLOCK) * BLOCK
    assert result.num_hit_tokens == groups * (per_group - 1) * hit_per_prompt
    assert result.num_prompt_hit_tokens == result.num_hit_tokens
    assert result.num_evictions == 0 and result.num_preemptions == 0
    assert result.num_queried_tokens == groups * per_group * num_tokens


def test_prompts_prefilled_in_one_step_do_not_hit_each_other():
    # Blocks enter the cache when the step that computes them is committed: four prompts of
    # one group admitted in the same step all miss; a fifth, admitted a step later, hits.
    requests = w.shared_prefix(1, 5, 48, 16, 2, seed=0)
    config = make_config(
        requests, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=256, prefill_tile=16
    )
    result = simulate(requests, config)
    assert result.num_hit_tokens == 48  # 4 x 64 tokens fill the budget of 256
    assert result.num_prefill_steps == 2


def test_multi_turn_hits_with_unlimited_cache():
    system, user, output = 40, 10, 7
    requests = w.multi_turn_chat(4, 3, system, user, output, seed=0)
    result = simulate(requests, sequential_config(requests), check_integrity=True)
    expected = 0
    for index, request in enumerate(requests):
        turn, conversation = divmod(index, 4)
        if turn == 0:
            shared = system if conversation else 0  # the shared system prompt
        else:
            shared = requests[index - 4].num_prompt_tokens  # the previous turn's prompt
        expected += min(shared // BLOCK, (request.num_prompt_tokens - 1) // BLOCK) * BLOCK
    assert result.num_hit_tokens == expected > 0


# Policies.

ROUNDS, PER_ROUND, SCAN, ENTRIES = 8, 24, 8, 8


def policy_contrast(policy) -> int:
    """Hit blocks of hot_prefix_with_scans with a cache of ENTRIES entries (one block each)."""
    requests = w.hot_prefix_with_scans(ROUNDS, PER_ROUND, SCAN, seed=0)
    config = SchedulerConfig(
        num_blocks=ENTRIES + 1,  # + the running request's partial block
        block_size=BLOCK,
        max_num_seqs=1,
        max_num_batched_tokens=32,
        max_model_len=64,
        prefill_tile=16,
    )
    result = simulate(requests, config, policy, check_integrity=True)
    return result.num_hit_tokens // BLOCK


def test_the_policies_rank_as_predicted_on_hot_prefix_with_scans():
    """The counts of docs/cache-policies.md: LFU > LRU > FIFO > MRU."""
    hot = ROUNDS * PER_ROUND // 2  # hot accesses
    hits = {policy: policy_contrast(policy) for policy in POLICY_NAMES}
    assert hits["lfu"] == hot - 1  # only the very first access misses
    assert SCAN + 1 >= ENTRIES
    assert hits["lru"] == hot - 1 - (ROUNDS - 1)  # each scan pushes the hot prefix out
    per_round = PER_ROUND // 2
    assert hits["fifo"] == ROUNDS * (per_round - math.ceil(per_round / ENTRIES))
    assert hits["mru"] == ENTRIES - 1  # hits until the cache is full, then none
    assert hits["lfu"] > hits["lru"] > hits["fifo"] > hits["mru"]


def example_policy_source() -> str:
    text = (ROOT / "docs" / "cache-policies.md").read_text()
    match = re.search(r"<!-- tested -->\s*```python\n(.*?)```", text, re.DOTALL)
    assert match, "docs/cache-policies.md lost its tested example"
    return match.group(1)


def test_the_documented_new_policy_works():
    source = example_policy_source()
    assert len(source.strip().splitlines()) <= 30
    namespace: dict = {}
    exec(compile(source, "docs/cache-policies.md", "exec"), namespace)
    policy_class = namespace["SegmentedLRUPolicy"]
    # Scan resistant like LFU: the reused hot prefix stays; the one-off prompts go first.
    assert policy_contrast(policy_class()) == policy_contrast("lfu") > policy_contrast("lru")
    requests = w.prefix_repetition(300, 12, 64, 8, 8, zipf_exponent=1.0, seed=0)
    config = make_config(requests, 64, block_size=BLOCK, max_num_seqs=8, prefill_tile=16)
    results = sweep(requests, config, [policy_class, "lru"], [24, 32], check_integrity=True)
    assert [r.policy for r in results] == ["slru", "lru", "slru", "lru"]
    assert all(r.num_evictions > 0 for r in results)
    # Popular prefixes (reused) outlive the one-off suffix and output blocks (never reused).
    assert results[0].num_hit_tokens > results[1].num_hit_tokens
    assert results[2].num_hit_tokens > results[3].num_hit_tokens


# Invariants and the step loop.


def small_cache_workload():
    requests = w.multi_turn_chat(6, 3, 32, 8, 24, seed=1) + w.shared_prefix(3, 3, 40, 8, 30)
    config = make_config(
        requests, 24, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=128, prefill_tile=16
    )
    return requests, config


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_small_cache_evicts_and_preempts_consistently(policy):
    requests, config = small_cache_workload()
    result = simulate(requests, config, policy, check_integrity=True)
    assert result.num_evictions > 0 and result.num_preemptions > 0
    # every admission computes what it did not hit, preempted requests included
    assert result.num_prefill_tokens == result.num_queried_tokens - result.num_hit_tokens
    assert result.num_queried_tokens > result.num_prompt_tokens  # re-admissions
    assert result.num_prompt_hit_tokens <= result.num_hit_tokens
    assert result.num_decode_steps > 0 and result.mean_ttft_steps >= 1


def test_counts_do_not_depend_on_pipelining():
    """The engine updates each step one step late (schedule N, then update N - 1); updating
    each step at once reaches the same counters."""
    requests, config = small_cache_workload()
    pipelined = simulate(requests, config, "lru")
    scheduler = Scheduler(config, eviction_policy="lru")
    for request in requests:
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        scheduler.add(scheduler.new_sequence(request.prompt_token_ids, params))
    while (batch := scheduler.schedule()) is not None:
        scheduler.update(batch, np.zeros(batch.num_seqs, np.int32))
    stats = scheduler.stats()
    assert (stats.num_queried_tokens, stats.num_hit_tokens, stats.num_evictions) == (
        pipelined.num_queried_tokens,
        pipelined.num_hit_tokens,
        pipelined.num_evictions,
    )
    assert scheduler.num_preemptions == pipelined.num_preemptions


def test_prefix_caching_off():
    requests, config = small_cache_workload()
    config = make_config(
        requests, 24, block_size=BLOCK, prefill_tile=16, enable_prefix_caching=False
    )
    result = simulate(requests, config)
    assert result.num_hit_tokens == result.num_evictions == result.num_queried_tokens == 0
    assert result.num_prefill_tokens >= result.num_prompt_tokens  # re-admissions recompute


def test_arrival_by_time():
    # Two prompts of one group: added together they share a step and both miss; arriving 10 s
    # apart with 1 s steps, the second hits the first's blocks.
    requests = w.shared_prefix(1, 2, 32, 4, 4, seed=0)
    config = make_config(requests, block_size=BLOCK, prefill_tile=16)
    assert simulate(requests, config).num_hit_tokens == 0
    timed = [
        w.Request(r.prompt_token_ids, r.max_tokens, t)
        for r, t in zip(requests, (0, 10), strict=True)
    ]
    result = simulate(timed, config, arrival="time", step_time=1.0)
    assert result.num_hit_tokens == 32
    assert result.num_prefill_steps == 2 and result.num_decode_steps == 6  # 1 + 3 each
    assert result.simulated_seconds == 10 + 4  # idle until 10 s, then the second's 4 steps
    assert result.mean_ttft_steps == 1
    with pytest.raises(ValueError, match="arrival"):
        simulate(timed, config, arrival="poisson")


def test_cache_sizes_and_refusals():
    requests = w.shared_prefix(2, 2, 20, 4, 8)  # 32 tokens = 2 blocks each
    assert blocks_for_all(requests, BLOCK) == 8
    assert default_cache_sizes(requests, BLOCK) == [2, 4, 8]
    with pytest.raises(ValueError, match="KV blocks"):
        simulate(requests, make_config(requests, 1, block_size=BLOCK, prefill_tile=16))


# The command line.


def test_cli_writes_csv_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    argv = [
        sys.executable,
        str(ROOT / "scripts" / "cache_sim.py"),
        "--workload=shared-prefix",
        "--groups=4",
        "--prompts-per-group=4",
        "--prefix-len=64",
        "--question-len=8",
        "--output-len=8",
        "--block-size=16",
        "--prefill-tile=16",
        "--max-num-seqs=4",
        "--cache-blocks=8,16,64",
        "--policies=lru,mru,jaxllm.cache:FIFOPolicy",
        f"--csv={tmp_path / 'out.csv'}",
        f"--json={tmp_path / 'out.json'}",
        f"--plot={tmp_path / 'out.png'}",
    ]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "hit rate" in result.stdout
    with open(tmp_path / "out.csv") as file:
        rows = list(csv.DictReader(file))
    assert [(r["policy"], r["num_blocks"]) for r in rows] == [
        (p, n) for n in ("8", "16", "64") for p in ("lru", "mru", "fifo")
    ]
    record = json.loads((tmp_path / "out.json").read_text())
    assert record["workload"]["groups"] == 4 and len(record["results"]) == 9
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--block-size=0", "--block-size must be at least 1"),
        ("--policies=lru,bogus", "got 'bogus'"),
        ("--policies=os:path", "os:path is not an EvictionPolicy subclass"),
        ("--policies=jaxllm.cache:PriorityPolicy", "PriorityPolicy() cannot be made"),
        ("--groups=0", "the workload has no requests"),
        ("--cache-blocks=4,0", "--cache-blocks takes sizes of at least 1 block"),
        ("--step-time=-1", "--step-time must be a finite number >= 0"),
        ("--step-time=nan", "--step-time must be a finite number >= 0"),
        ("--request-rate=5", "the workload has no requests"),  # with --groups=0 (below)
        ("--csv=no/such/dir/out.csv", "--csv no/such/dir/out.csv: no such directory"),
        ("--json=scripts", "--json scripts: a directory, not a file"),
        ("--policies=,", "--policies names no policy: ','"),
        ("--max-model-len=8", "leaves no room for an output token"),
        ("--cache-blocks=1", "KV blocks of 256 tokens, but the whole cache has 1"),
        ("--trace=no/such/trace.jsonl", "no/such/trace.jsonl"),
    ],
)
def test_cli_refuses_bad_flags_before_any_simulation(flag, message):
    script = str(ROOT / "scripts" / "cache_sim.py")
    workload = "--workload=trace" if flag.startswith("--trace") else "--workload=shared-prefix"
    groups = "--groups=0" if flag.startswith("--request-rate") else "--groups=2"
    argv = [sys.executable, script, workload, groups, flag]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not result.stdout  # nothing simulated


def test_cli_takes_a_policy_class_from_the_current_directory(tmp_path):
    """As docs/cache-policies.md runs it: `module:Class` from where the command runs."""
    (tmp_path / "my_policies.py").write_text(
        "from jaxllm.cache import LRUPolicy\n\nclass Mine(LRUPolicy):\n    name = 'mine'\n"
    )
    script = str(ROOT / "scripts" / "cache_sim.py")
    argv = [sys.executable, script, "--workload=shared-prefix", "--groups=2"]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [*argv, "--policies=lru,my_policies:Mine"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "mine" in result.stdout


def test_output_tokens_are_those_max_model_len_leaves():
    requests = [w.Request(np.arange(1, 11), 200), w.Request(np.arange(20, 25), 3)]
    result = simulate(requests, make_config(requests, block_size=16, max_model_len=22))
    assert result.num_output_tokens == 12 + 3


def test_sweep_takes_policy_classes_not_instances():
    requests = w.shared_prefix(2, 2, 16, 4, 4)
    config = make_config(requests, block_size=16)
    with pytest.raises(ValueError, match="pass LRUPolicy, the class, not an instance"):
        sweep(requests, config, [LRUPolicy()])
    assert sweep(requests, config, [LRUPolicy])[0].policy == "lru"


def test_a_policy_without_a_name_of_its_own_goes_by_its_class():
    """Not by its base's name, which would mix its results with the base's."""

    class TailFirst(LRUPolicy):
        pass

    requests = w.shared_prefix(2, 2, 16, 4, 4)
    results = sweep(requests, make_config(requests, block_size=16), [LRUPolicy, TailFirst])
    assert [result.policy for result in results] == ["lru", "tailfirst"]
    assert format_table(results).splitlines()[2].startswith("tailfirst ")
