"""The profiling scripts refuse a count below its least value as a usage error (exit 2, naming
the flag) before they build or time anything (`flags.at_least`)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import pytest

from jaxllm.research.flags import at_least

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        ("decode_step.py", ["--batch", "0"], "--batch: must be at least 1, got 0"),
        ("forward_call_time.py", ["--runs", "-1"], "--runs: must be at least 1, got -1"),
        ("step_timeline.py", ["--steps", "0"], "--steps: must be at least 1, got 0"),
        ("grammar_backends.py", ["--threads", "2", "0"], "--threads: must be at least 1"),
        ("callback_cost.py", ["--width", "x"], "--width: not an integer: 'x'"),
        ("attention_kernels.py", ["--table-width", "-1"], "--table-width: must be at least 0"),
        ("profile_host.py", ["--num-seqs", "0"], "--num-seqs: must be at least 1, got 0"),
        ("profile_host.py", ["--window-length", "0"], "--window-length more than 0"),
        ("bf16_noise.py", ["--layers", "0"], "--layers: must be at least 1, got 0"),
        ("host_bench.py", ["--iterations", "0"], "--iterations: must be at least 1, got 0"),
    ],
)
def test_a_count_below_its_least_is_a_usage_error(script, flags, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, *flags])
    monkeypatch.syspath_prepend(str(SCRIPTS))  # scripts import each other
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_at_least_takes_integers_from_its_least():
    parse = at_least(0)
    assert parse("0") == 0 and parse("12") == 12
    for text in ("-1", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
