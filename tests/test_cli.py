"""`python -m jaxllm generate|chat|bench`, run in-process on the embedded random qwen3-tiny.

The README's main job is `python -m jaxllm generate "The capital of France is"`; these tests run
the same code with a smaller ladder (fewer buckets to compile) and fewer tokens.
"""

from __future__ import annotations

import json
import logging
import re
import time

import pytest

from jaxllm.__main__ import main

SMALL = ["--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]


def test_readme_main_job(capsys, caplog):
    """`python -m jaxllm generate "The capital of France is"`, exactly."""
    start = time.perf_counter()
    code = main(["generate", "The capital of France is"])
    elapsed = time.perf_counter() - start

    captured = capsys.readouterr()
    assert code == 0
    _, text_and_footer = captured.out.split("=== 'The capital of France is'\n")
    text, footer = text_and_footer.rsplit("\n--- ", 1)
    assert re.fullmatch(r"(\d+) tokens, finish_reason=(length|stop)\n", footer)
    assert text.strip()
    # Only the buckets this prompt needs are compiled, and without a warning.
    assert "Compiling buckets" not in captured.err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert elapsed < 60


def test_generate_compiling_the_ladder_at_startup(capsys):
    argv = ["generate", "The capital of France is", *SMALL, "--compile-at-startup"]
    code = main([*argv, "--max-tokens", "8", "--ignore-eos"])

    captured = capsys.readouterr()
    assert code == 0
    assert "Compiling buckets" in captured.err
    assert "--- 8 tokens, finish_reason=length" in captured.out


def test_chat_and_several_prompts(capsys):
    code = main(
        [
            "chat",
            "Hi",
            "Bye",
            *SMALL,
            "--max-tokens",
            "3",
            "--temperature",
            "0",
            "--no-enable-thinking",
            "--seed",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("=== ") == 2 and "=== 'Hi'" in out and "=== 'Bye'" in out
    assert out.count("tokens, finish_reason=") == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--no-such-flag"],
        ["generate", "--dtype", "float16"],
        ["serve"],
        [],
    ],
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_bench_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--num-seqs" in capsys.readouterr().out


def test_bench_record_on_the_cpu(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--num-seqs", "2", "--max-input-len", "120", "--max-output-len", "110"]
    code = main([*argv, "--no-compile-at-startup", "--json", str(path)])

    assert code == 0
    record = json.loads(path.read_text())
    assert f"Total: {record['output_tokens']}tok" in capsys.readouterr().out
    assert 200 <= record["output_tokens"] <= 220 and record["num_seqs"] == 2
    assert record["decode_steps"] >= 99
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
    assert record["scan_layers"] is True  # the CPU's default


@pytest.mark.parametrize("flag", ["--max-input-len", "--max-output-len"])
def test_bench_refuses_lengths_below_the_workloads_minimum(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", flag, "32"])
    assert exit_info.value.code == 2
    assert f"{flag} must be at least 100" in capsys.readouterr().err
