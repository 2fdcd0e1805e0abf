"""`python -m jaxllm generate|chat|bench`, run in-process on the embedded random qwen3-tiny.

The README's main job is `python -m jaxllm generate "The capital of France is"`; these tests run
the same code with a smaller ladder (fewer buckets to compile) and fewer tokens.
"""

from __future__ import annotations

import time

import pytest

from jaxllm.__main__ import main

SMALL = ["--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]


def test_generate(capsys):
    start = time.perf_counter()
    code = main(
        ["generate", "The capital of France is", *SMALL, "--max-tokens", "8", "--ignore-eos"]
    )
    elapsed = time.perf_counter() - start

    out = capsys.readouterr().out
    assert code == 0
    assert "=== 'The capital of France is'\n" in out
    assert "--- 8 tokens, finish_reason=length" in out
    # The one prompt's text sits between its header and its footer.
    text = out.split("=== 'The capital of France is'\n")[1].split("\n--- 8 tokens")[0]
    assert text.strip()
    assert elapsed < 120


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
