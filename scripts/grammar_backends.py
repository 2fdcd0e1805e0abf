"""llguidance against xgrammar, the two grammar libraries an engine can take its token masks from,
on the work a step of the benchmark gives them: the tokenizer set up once, the bench's JSON
schema compiled, then each step a mask for every constrained row (filled in parallel) and the
sampled token fed to each row's matcher. Tokens are drawn uniformly from each row's mask, as
random weights would. The schema allows no free whitespace, as the bench's; `--no-max-length`
drops its strings' `maxLength`. One JSON record; a library that is not installed is reported as
such.
With `--threads`, llguidance also runs on that many threads, with as many compiled copies of the
schema (`jaxllm.matchers.MASK_THREADS`).

    python scripts/grammar_backends.py [--rows 256] [--steps 200] [--threads 1 4 ...]
        [--no-max-length] [--json F]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import time
from pathlib import Path

import numpy as np

from jaxllm.research.bench import BENCH_SCHEMA
from jaxllm.research.flags import at_least
from jaxllm.tokenizer import qwen3_tokenizer

VOCAB_SIZE = 151_936  # Qwen3's embedding rows (the tokenizer has 151,669 tokens)
EOS = 151_645


def allowed_tokens(bitmask: np.ndarray) -> list[np.ndarray]:
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB_SIZE]
    return [np.flatnonzero(row) for row in bits]


def schema_text(max_length: bool = True) -> str:
    """BENCH_SCHEMA as JSON text, with or without its strings' maxLength."""
    schema = copy.deepcopy(BENCH_SCHEMA)
    if not max_length:
        del schema["items"]["properties"]["name"]["maxLength"]
        del schema["items"]["properties"]["tags"]["items"]["maxLength"]
    return json.dumps(schema)


def run_llguidance(tokenizer, rows, steps, rng, schema: str, threads: int | None = None) -> dict:
    """With `threads`, rows copy `threads` compiled matchers in turn, as the engine's do."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    start = time.perf_counter()
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE, eos_token=EOS)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})
    compiled = [
        llguidance.LLMatcher(lltokenizer, grammar, log_level=0) for _ in range(threads or 1)
    ]
    compile_s = (time.perf_counter() - start) / len(compiled)
    matchers = [compiled[row % len(compiled)].deep_copy() for row in range(rows)]
    executor = llguidance.LLExecutor(threads)
    bitmask = llguidance.numpy.allocate_token_bitmask(rows, VOCAB_SIZE)
    fill, accept = [], []
    for _ in range(steps):
        start = time.perf_counter()
        pairs = [(matcher, index) for index, matcher in enumerate(matchers)]
        llguidance.numpy.fill_next_token_bitmask_par(executor, pairs, bitmask)
        fill.append(time.perf_counter() - start)
        tokens = [int(rng.choice(allowed)) for allowed in allowed_tokens(bitmask)]
        start = time.perf_counter()
        executor.consume_token_par(list(zip(matchers, tokens, strict=True)))
        accept.append(time.perf_counter() - start)
    errors = sum(matcher.is_error() for matcher in matchers)
    return summary(setup_s, compile_s, fill, accept, errors)


def run_xgrammar(tokenizer, rows: int, steps: int, rng, schema: str) -> dict:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS]
    )
    compiler = xgrammar.GrammarCompiler(info)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False)
    compile_s = time.perf_counter() - start
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
    batch = xgrammar.BatchGrammarMatcher()
    bitmask = np.full((rows, -(-VOCAB_SIZE // 32)), -1, np.int32)
    fill, accept = [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        fill.append(time.perf_counter() - start)
        tokens = [int(rng.choice(allowed)) for allowed in allowed_tokens(bitmask)]
        start = time.perf_counter()
        xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        accept.append(time.perf_counter() - start)
    errors = sum(matcher.is_terminated() for matcher in matchers)
    return summary(setup_s, compile_s, fill, accept, errors)


def summary(setup_s, compile_s, fill, accept, errors) -> dict:
    ms = lambda seconds, q: 1e3 * float(np.percentile(seconds, q))
    return {
        "tokenizer_setup_s": setup_s,
        "schema_compile_ms": 1e3 * compile_s,
        "fill_ms_p50": ms(fill, 50),
        "fill_ms_p99": ms(fill, 99),
        "accept_ms_p50": ms(accept, 50),
        "rows_in_error_or_terminated": int(errors),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=at_least(1), default=256)
    parser.add_argument("--steps", type=at_least(1), default=200)
    parser.add_argument(
        "--threads", type=at_least(1), nargs="*", default=[],
        help="llguidance's thread counts to time besides its default, as many compiled copies",
    )  # fmt: skip
    parser.add_argument("--no-max-length", action="store_true", help="strings of any length")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    schema = schema_text(max_length=not args.no_max_length)
    tokenizer = qwen3_tokenizer()
    record = {"rows": args.rows, "steps": args.steps, "cpus": len(os.sched_getaffinity(0))}
    record["max_length"] = not args.no_max_length
    runs = [("llguidance", run_llguidance), ("xgrammar", run_xgrammar)]
    runs += [
        (f"llguidance-{n}-threads", functools.partial(run_llguidance, threads=n))
        for n in args.threads
    ]
    for name, run in runs:
        try:
            record[name] = run(tokenizer, args.rows, args.steps, np.random.default_rng(0), schema)
        except ImportError as error:
            record[name] = f"not installed: {error}"
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
