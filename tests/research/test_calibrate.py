"""Timing the engine's steps (`jaxllm.research.calibrate`) and `scripts/calibrate_step_cost.py`
on tiny random models on the CPU: what is recorded and how it adds up. CPU timings are noisy, so
the checks are of structure and sums, and a loose bound on the simulator's TTFT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from support.engine import assert_idle
from support.repo import ROOT

from jaxllm.research import workloads as w
from jaxllm.research.calibrate import calibration_phases, run_timed
from jaxllm.research.cost_model import StepCostModel, StepWork
from jaxllm.sched import SchedulerConfig


def test_calibration_phases_span_the_ladder_within_the_limits():
    config = SchedulerConfig(
        num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
        max_model_len=64, prefill_tile=16,
    )  # fmt: skip
    phases = calibration_phases(config, decode_steps=8, repeats=2)
    requests = [r for phase in phases for r in phase]
    assert all(r.num_prompt_tokens + r.max_tokens <= 64 for r in requests)
    single_prefills = [
        phase[0].num_prompt_tokens
        for phase in phases
        if len(phase) == 1 and phase[0].max_tokens == 1
    ]
    assert {15, 31} <= set(single_prefills)  # buckets of 16 and 32 tokens, twice each
    decode_batches = {len(phase) for phase in phases if phase[0].max_tokens == 8}
    assert decode_batches == {1, 2, 4}
    # A prefix of one block (half the longest prompt, in whole blocks) is cached first, then
    # prompts of 16 and 32 more tokens after it, twice each.
    (prefix,) = [p[0].prompt_token_ids[:16] for p in phases if p[0].num_prompt_tokens == 17]
    prefixed = [
        phase
        for phase in phases
        if all(
            r.num_prompt_tokens > 17 and (r.prompt_token_ids[:16] == prefix).all() for r in phase
        )
    ]
    assert [[r.num_prompt_tokens for r in phase] for phase in prefixed] == [[31, 31], [47, 47]]


def test_run_timed_samples_every_plan_and_adds_up(llm):
    engine = llm.engine
    requests = w.with_poisson_arrivals(
        w.shared_prefix(2, 3, 32, 8, 4, vocab_size=256, seed=7), 40.0, seed=2
    )
    before = engine.stats.snapshot()
    run = run_timed(engine, requests)
    steps = engine.stats.since(before)
    assert len(run.samples) == steps["prefill_steps"] + steps["decode_steps"] > 0
    seconds = np.array([s for _, s in run.samples])
    assert (seconds > 0).all() and seconds.sum() <= run.wall_seconds
    assert sum(work.num_prefill_tokens > 0 for work, _ in run.samples) == steps["prefill_steps"]
    assert run.samples[0][0].from_idle == 1
    assert ((run.ttft_seconds > 0) & (run.ttft_seconds <= run.wall_seconds)).all()
    assert "schedule" not in vars(engine.scheduler)  # the log let go of the scheduler
    assert_idle(llm)


def test_script_calibrates_and_replays_on_the_tiny_model(tmp_path):
    cost, record = tmp_path / "cost.json", tmp_path / "replay.json"
    argv = [
        sys.executable,
        str(ROOT / "scripts" / "calibrate_step_cost.py"),
        "replay",
        "--model=random:qwen3-tiny",
        "--max-num-seqs=4",
        "--max-model-len=64",
        "--max-num-batched-tokens=64",
        "--block-size=16",
        "--decode-steps=6",
        "--repeats=1",
        "--num-requests=12",
        "--request-rate=8",
        "--num-prefixes=3",
        "--hash-block-size=16",
        "--prefix-blocks", "1", "2",
        "--own-blocks", "1", "1",
        "--output-length", "2", "8",
        f"--out={cost}",
        f"--json={record}",
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "simulator / engine mean TTFT" in result.stdout

    model = StepCostModel.load(cost)
    assert all(price >= 0 for price in model.prices)
    assert model.step_seconds(StepWork(num_decode_rows=1, num_context_tokens=16)) > 0
    assert model.step_seconds(StepWork(num_prefill_tokens=16, num_prefill_pairs=136)) > 0
    assert "qwen3-tiny" in model.description
    replay = json.loads(record.read_text())
    assert replay["num_requests"] == 12
    assert replay["compilations_during_replay"] == 0  # compiled at start-up: nothing is timed
    for side in ("engine_ttft_seconds", "simulator_ttft_seconds"):
        summary = replay[side]
        assert set(summary) == {"mean", "p50", "p99"}
        assert 0 < summary["p50"] <= summary["p99"] and summary["mean"] > 0
    assert set(replay["ttft_ratio"]) == {"mean", "p50", "p99"}
    # Loose on a shared 2-core CPU: the acceptance (20%) is for the GPU.
    assert 0.25 < replay["ttft_ratio"]["mean"] < 4
    assert replay["cost_model"] == {
        "prices": model.prices._asdict(),
        "description": model.description,
    }
    assert replay["fit"]["all"]["steps"] > 20
    assert replay["engine_steps"] > 0 and replay["simulator_steps"] > 0


def test_script_simulate_takes_a_policy_class_and_refuses_bad_flags(tmp_path):
    """A bad flag, trace or cost model is a usage error (exit 2, no traceback), and replay's
    before it builds an engine."""
    (tmp_path / "my_policies.py").write_text(
        "from jaxllm.cache import LRUPolicy\n\nclass Mine(LRUPolicy):\n    name = 'mine'\n"
    )
    script = str(ROOT / "scripts" / "calibrate_step_cost.py")
    trace = ["--num-requests=6", "--num-prefixes=2", "--hash-block-size=16", "--block-size=16"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    cases = [
        ("simulate", ["--policy=my_policies:Mine"], "mine"),
        ("simulate", ["--policy=no-such-policy"], "no-such-policy"),
        ("simulate", ["--cache-blocks=0"], "num_blocks must be an integer >= 1, got 0"),
        ("simulate", ["--cache-blocks=1", "--own-blocks", "3", "3"], "the whole cache has 1"),
        ("simulate", ["--num-requests=0"], "num_requests must be >= 1, got 0"),
        ("replay", ["--cost-model=missing.json"], "missing.json"),
        ("replay", ["--trace=missing.jsonl"], "missing.jsonl"),
        ("replay", ["--hash-block-size=512"], "tokens; max_model_len is 256 (--max-model-len"),
        ("simulate", ["--json=no/such/dir/x.json"], "--json no/such/dir/x.json: no such directory"),
        ("replay", ["--out=."], "--out .: a directory, not a file"),
    ]
    for command, flags, expected in cases:
        argv = [sys.executable, script, command, *trace, *flags]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)
        assert result.returncode == (0 if expected == "mine" else 2), result.stderr[-2000:]
        assert expected in (result.stdout if expected == "mine" else result.stderr)
        assert "Traceback" not in result.stderr
