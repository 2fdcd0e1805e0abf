"""`python -m jaxllm generate|chat|bench`, run in-process on the embedded random qwen3-tiny.

The README's main job is `python -m jaxllm generate "The capital of France is"`; these tests run
the same code with a smaller ladder (fewer buckets to compile) and fewer tokens.
"""

from __future__ import annotations

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
