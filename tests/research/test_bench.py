"""`scripts/bench.py` (`jaxllm.research.bench`) on the CPU: its flags, its record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxllm.research.bench import main


def test_bench_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--num-seqs" in capsys.readouterr().out


def test_bench_record_on_the_cpu(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--num-seqs", "2", "--max-input-len", "120", "--max-output-len", "110"]
    code = main([*argv, "--no-compile-at-startup", "--json", str(path)])

    assert code == 0
    record = json.loads(path.read_text())
    assert f"Total: {record['output_tokens']}tok" in capsys.readouterr().out
    assert 200 <= record["output_tokens"] <= 220 and record["num_seqs"] == 2
    assert record["decode_steps"] >= 99
    assert record["decode_forward_passes"] == record["decode_steps"]  # one step a plan here
    # compiled as steps first need them, during the run: counted
    assert record["executables_built_during_run"] >= 1 and record["bound_ratio"] is None
    # The parts of a decode step's wall time are within it.
    parts = record["decode_dispatch_ms_per_step"] + record["decode_wait_ms_per_step"]
    assert 0 < parts <= record["decode_ms_per_step"]
    # So are the start-up's phases (no compile phase: --no-compile-at-startup).
    phases = record["startup_phases_s"]
    assert set(phases) == {
        "load weights",
        "load the tokenizer",
        "size the KV cache",
        "allocate the KV cache",
    }
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) <= record["startup_s"]
    assert record["attention_kernels"]["decode"] == "reference"  # the CPU's default


@pytest.mark.parametrize("flag", ["--max-input-len", "--max-output-len"])
def test_bench_refuses_lengths_below_the_workloads_minimum(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([flag, "32"])
    assert exit_info.value.code == 2
    assert f"{flag} must be at least 100" in capsys.readouterr().err


def test_bench_repeat_records_the_median_run(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["--fixed-lengths", "16", "8", "--repeat", "3", "--no-compile-at-startup"]
    assert main([*argv, "--json", str(path)]) == 0

    record = json.loads(path.read_text())
    runs = record["runs_tok_s"]
    assert len(runs) == 3 and record["throughput_tok_s"] == sorted(runs)[1]
    assert capsys.readouterr().out.count("Total: 8tok") == 3
    assert record["output_tokens"] == 8 and record["num_seqs"] == 1


def test_bench_fits_the_models_positions(tmp_path, capsys):
    """A model of 512 positions runs fixed lengths at the default max_model_len (at most the
    model's): only longer requests raise it."""
    from support.hf import save_checkpoint

    model = save_checkpoint(tmp_path / "model", vocab_size=151936, tied=True).path  # Qwen's ids
    path = tmp_path / "bench.json"
    argv = ["--model", str(model), "--no-compile-at-startup", "--json", str(path)]
    assert main([*argv, "--fixed-lengths", "16", "8"]) == 0
    assert json.loads(path.read_text())["output_tokens"] == 8
    with pytest.raises(SystemExit):
        main([*argv, "--fixed-lengths", "500", "100"])
    assert "max_model_len=600 is more than" in capsys.readouterr().err


def test_bench_refuses_a_trace_with_arrival_times(tmp_path, capsys):
    from jaxllm.research.workloads import Request, save_trace

    trace = tmp_path / "trace.jsonl"
    save_trace(trace, [Request(np.arange(8), 4, arrival_time=0.0), Request(np.arange(9), 4, 30.0)])
    with pytest.raises(SystemExit):
        main(["--workload", "trace", "--trace", str(trace)])
    assert "arrival times; bench.py runs every request at once" in capsys.readouterr().err


def test_bench_repeat_needs_fixed_lengths(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--repeat", "2"])
    assert exit_info.value.code == 2
    assert "--repeat" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-seqs", "0"], "--num-seqs must be at least 1"),
        (["--workload", "prefix-repetition", "--num-seqs", "4"], "do not apply to a --workload"),
        (["--workload", "prefix-repetition", "--request-rate", "2"], "do not apply"),
        (["--eviction-policy", "bogus"], "invalid choice: 'bogus'"),
        (["--workload", "shared-prefix", "--groups", "0"], "the workload has no requests"),
        (["--fixed-lengths", "0", "4"], "two lengths of at least 1 token"),
        (["--logprobs", "-1"], "SamplingParams.logprobs must be"),
        (["--tp", "3"], "tensor_parallel_size must be 1, 2, 4 or 8"),
        (["--block-size", "7"], "kvcache_block_size must be"),
        (["--block-size", "0"], "kvcache_block_size must be"),
        (["--max-input-len", "0"], "--max-input-len must be at least 100"),
        (["--workload", "prefix-repetition", "--fixed-lengths", "8", "8"], "do not apply"),
        (["--workload", "prefix-repetition", "--max-input-len", "200"], "do not apply"),
        (["--workload", "trace", "--trace", "no/such/trace.jsonl"], "no/such/trace"),
        (["--model", "no/such/dir"], "does not exist"),
        (["--seed", "5"], "--seed apply to a --workload only"),
        (["--groups", "3", "--output-len", "7"], "--groups, --output-len apply to a --workload"),
        (["--fixed-lengths", "8", "4", "--max-output-len", "300"], "do not apply to --fixed"),
        (["--fixed-lengths", "8", "4", "--repeat", "2"], "--repeat takes an odd count"),
        (["--json", "no/such/dir/run.json"], "--json no/such/dir/run.json: no such directory"),
        (["--json", "."], "--json .: a directory, not a file"),
    ],
)
def test_bench_refuses_flags_it_would_ignore_or_trip_on(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
