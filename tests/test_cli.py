"""`python -m jaxllm generate|chat`, run in-process on the embedded random qwen3-tiny.

The README's main job is `python -m jaxllm generate "The capital of France is"`; these tests run
the same code with a smaller ladder (fewer buckets to compile) and fewer tokens.
"""

from __future__ import annotations

import io
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


def test_sampling_defaults_are_the_models_under_the_flags(capsys, monkeypatch):
    """Flags left out sample as the model's generation config says (here greedy, 5 tokens: the
    same text whatever the seed); a flag given wins."""
    from jaxllm import SamplingParams
    from jaxllm.llm import LLM

    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    monkeypatch.setattr(LLM, "get_default_sampling_params", lambda self: greedy)
    texts = []
    for seed in ("1", "2"):
        assert main(["generate", "A", *SMALL, "--seed", seed, "--ignore-eos"]) == 0
        ((text, _),) = completions(out := capsys.readouterr().out)
        assert "--- 5 tokens" in out
        texts.append(text)
    assert texts[0] == texts[1]
    assert main(["generate", "A", *SMALL, "--max-tokens", "3", "--ignore-eos"]) == 0
    assert "--- 3 tokens" in capsys.readouterr().out


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


def completions(out: str) -> list[tuple[str, str]]:
    """(text, finish reason) of each prompt's output, as `main` prints them."""
    blocks = re.findall(r"=== .*?\n(.*?)\n--- \d+ tokens, finish_reason=(\w+)\n", out, re.S)
    return [(text, reason) for text, reason in blocks]


def test_constrained_generation_from_the_command_line(capsys, tmp_path):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    sampling = ["--temperature", "1", "--top-p", "1", "--max-tokens", "32", "--seed", "3"]
    cases = {
        "choice": (["--choice", "yes", "no", "maybe"], lambda text: text in ("yes", "no", "maybe")),
        "regex": (["--regex", "[0-9]{3}-[a-c]{2}"], re.compile("[0-9]{3}-[a-c]{2}").fullmatch),
        "json": (
            ["--json-schema", str(schema_file), "--disable-any-whitespace"],
            lambda text: jsonschema.validate(json.loads(text), schema) is None,
        ),
    }
    for flags, valid in cases.values():
        assert main(["generate", "A", "B", *SMALL, *sampling, *flags]) == 0
        outputs = completions(capsys.readouterr().out)
        assert len(outputs) == 2
        assert all(reason == "stop" and valid(text) for text, reason in outputs), outputs


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--choice", "a", "--regex", "b"], "not allowed with argument"),
        (["--json-schema", "no/such/file.json"], "No such file"),
        (["--regex", "(unclosed"], "StructuredOutputsParams.regex is invalid"),
        (["--regex", "a", "--disable-any-whitespace"], "applies to --json-schema only"),
    ],
)
def test_bad_constraints_exit_with_the_reason_before_the_engine_starts(
    flags, message, capsys, monkeypatch
):
    pytest.importorskip("llguidance")
    monkeypatch.setattr("jaxllm.llm.LLM", engine_must_not_start)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "A", *SMALL, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_prompts_after_choice_are_refused_not_taken_as_choices(capsys, monkeypatch):
    """--choice's values run to the next flag: a prompt after them would be one more choice,
    and the default prompt would run. Refused, with the command's usage."""
    monkeypatch.setattr("jaxllm.llm.LLM", engine_must_not_start)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *SMALL, "--choice", "yes", "no", "Is the sky blue?"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "put the prompts before --choice" in error
    assert error.startswith("usage: python -m jaxllm generate")


def test_prompts_after_flags_and_a_seed_per_prompt(capsys):
    """Prompts may follow the flags; with --seed, prompt i samples with seed + i: equal
    prompts differ, and a second run repeats the first."""
    argv = ["generate", "A", *SMALL, "--temperature", "1", "--top-p", "1", "--max-tokens", "6"]
    argv += ["--ignore-eos", "--seed", "5", "A"]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        runs.append(completions(capsys.readouterr().out))
    assert runs[0] == runs[1]
    (first, _), (second, _) = runs[0]
    assert first != second


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["A\udcff"], "prompt 'A\\udcff' is not UTF-8 text"),
        (["A", "--choice", "a", "\udcff"], "--choice '\\udcff' is not UTF-8 text"),
        (["A", "--regex", "a\udcff"], "--regex 'a\\udcff' is not UTF-8 text"),
        (["A", "--json-schema", "latin-1.json"], "latin-1.json is not UTF-8 text (invalid"),
    ],
)
def test_text_that_is_not_utf8_exits_naming_it(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin-1.json").write_bytes('{"enum": ["é"]}'.encode("latin-1"))
    monkeypatch.setattr("jaxllm.llm.LLM", engine_must_not_start)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_schema_file_with_a_byte_order_mark_and_output_the_terminal_cannot_encode(
    monkeypatch, tmp_path
):
    pytest.importorskip("llguidance")
    schema = tmp_path / "schema.json"
    schema.write_bytes('{"enum": ["é"]}'.encode("utf-8-sig"))
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr("sys.stdout", out)
    assert main(["generate", "A", *SMALL, "--json-schema", str(schema)]) == 0
    out.flush()
    assert '"\\xe9"' in out.buffer.getvalue().decode("ascii")


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch):
    """`main` is also the installed `jaxllm` command's entry point: it returns the status."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("jaxllm.llm.LLM", interrupted)
    assert main(["generate", "A", *SMALL]) == 130


def test_a_reader_gone_before_the_output_exits_1_without_a_traceback(monkeypatch, tmp_path):
    """`python -m jaxllm generate ... | head -1`: stdout's reader closed the pipe."""

    def closed_pipe(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("jaxllm.__main__.print", closed_pipe, raising=False)
    with open(tmp_path / "stdout", "w") as stdout:
        monkeypatch.setattr("sys.stdout", stdout)
        assert main(["generate", "A", *SMALL, "--max-tokens", "2"]) == 1


def test_an_engine_too_big_for_the_host_exits_with_usage(monkeypatch, capsys):
    """Step buffers sized by --max-num-seqs or --max-num-batched-tokens past the host's
    memory (numpy's MemoryError): a usage error, not a traceback."""

    def too_big(*args, **kwargs):
        raise MemoryError("Unable to allocate 2.32 TiB for an array")

    monkeypatch.setattr("jaxllm.llm.LLM", too_big)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "A", *SMALL, "--max-num-batched-tokens", "2147483647"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "out of host memory starting the engine: Unable to allocate" in error


def engine_must_not_start(*args, **kwargs):
    raise AssertionError("the engine started")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-model-len", "0"], "max_model_len must be"),
        (["--tp", "3"], "tensor_parallel_size must be 1, 2, 4 or 8, got 3"),
        (["--model", "no/such/dir"], "does not exist"),
    ],
)
def test_bad_engine_flags_exit_with_the_reason(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "A", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
