"""nano-vllm's throughput benchmark, exactly, plus a JSON record and the physical bound.

`python scripts/bench.py` (or `python -m jaxllm.research.bench`) on a GPU runs nano-vllm's workload:
seed 0, 256 sequences, prompts of randint(100, 1024) random token ids, max_tokens randint(100,
1024), temperature 0.6, ignore_eos; 133,966 output tokens. Without an accelerator it runs a small
workload on `random:qwen3-tiny` and says so.

`--fixed-lengths IN OUT` gives every sequence (`--num-seqs`, default 1) a prompt of IN random
token ids and OUT output tokens: `--num-seqs 1 --fixed-lengths 512 512` is one stream, the
latency a person waits on.

`--workload shared-prefix|multi-turn|prefix-repetition|hot-prefix-scans|trace` runs one of
`jaxllm.research.workloads` instead (same sampling, each request seeded by its prompt's tokens),
and adds time to first token, the prefix cache's counters, and the simulator's prediction of
them for the engine's exact scheduler settings (docs/cache-policies.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import xxhash

from jaxllm.cache import CacheStats
from jaxllm.cache.eviction import POLICIES
from jaxllm.platform import ATTENTION_BACKENDS, ATTENTION_ENV, Platform
from jaxllm.research.bound import physical_bound
from jaxllm.research.flags import check_output
from jaxllm.research.workloads import Request, add_workload_arguments, workload_from_arguments

# nano-vllm's workload draws prompt and output lengths from [MIN_LEN, max].
MIN_LEN = 100
# The flags a `--workload` leaves out: its requests come as they are.
WORKLOAD_IGNORES = (
    "--num-seqs", "--request-rate", "--fixed-lengths", "--max-input-len", "--max-output-len",
)  # fmt: skip
# `--json-schema`: an array of at least 200 small objects, so no output ends before its
# max_tokens and the batch shrinks as in the unconstrained run.
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        },
        "required": ["id", "name", "tags"],
        "additionalProperties": False,
    },
}
# `--json-schema text`: one free-text field that outlasts max_tokens (an essay in JSON), where
# tokens drawn without the mask mostly fit, as a trained model's mostly do.
TEXT_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 10_000}},
    "required": ["text"],
}
SCHEMAS = {"bench": BENCH_SCHEMA, "text": TEXT_SCHEMA}


def count_compilations() -> list[float]:
    """A list that grows by one for every XLA executable built in this process from now on
    (any at all, the engine's or not)."""
    import jax

    compilations: list[float] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compilations.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    return compilations


def workload(num_seqs: int, max_input_len: int, max_output_len: int):
    """nano-vllm's bench.py workload: (prompt token ids, max_tokens), seeded with 0."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(MIN_LEN, max_input_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [random.randint(MIN_LEN, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def fixed_workload(num_seqs: int, input_len: int, output_len: int, seed: int = 0):
    """`num_seqs` prompts of `input_len` random token ids, `output_len` tokens each."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, 10000, (num_seqs, input_len)).tolist()
    return prompts, [output_len] * num_seqs


def workload_record(
    args: argparse.Namespace,
    requests: list[Request],
    llm,
    outputs: list,
    elapsed: float,
    stats_before: CacheStats,
    preemptions_before: int,
) -> dict:
    """The workload run's latency and prefix-cache figures, and the simulator's prediction of
    the latter for the engine's scheduler settings."""
    from jaxllm.research.cache_sim import simulate

    stats = llm.cache_stats()
    ttft = np.array([output.metrics.time_to_first_token for output in outputs]) * 1e3
    queried = stats.num_queried_tokens - stats_before.num_queried_tokens
    hits = stats.num_hit_tokens - stats_before.num_hit_tokens
    predicted = simulate(requests, llm.engine.scheduler.config, args.eviction_policy)
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    return {
        "workload": args.workload,
        "workload_args": {k: v for k, v in vars(args).items() if k not in ("json", "model")},
        "prefix_caching": not args.no_prefix_caching,
        "eviction_policy": args.eviction_policy,
        "prompt_tokens": prompt_tokens,
        "total_tok_s": (prompt_tokens + sum(r.max_tokens for r in requests)) / elapsed,
        "ttft_ms_mean": float(ttft.mean()),
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p90": float(np.percentile(ttft, 90)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "cache_queried_tokens": queried,
        "cache_hit_tokens": hits,
        "cache_hit_rate": hits / queried if queried else 0.0,
        "prompt_hit_tokens": sum(output.num_cached_tokens for output in outputs),
        "cache_evictions": stats.num_evictions - stats_before.num_evictions,
        "preemptions": llm.engine.scheduler.num_preemptions - preemptions_before,
        "sim_hit_tokens": predicted.num_hit_tokens,
        "sim_prompt_hit_tokens": predicted.num_prompt_hit_tokens,
        "sim_evictions": predicted.num_evictions,
        "sim_preemptions": predicted.num_preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__)
    parser.add_argument("--model", default=None, help="default: random:qwen3-0.6b on a GPU")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--max-input-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument(
        "--fixed-lengths",
        type=int,
        nargs=2,
        metavar=("IN", "OUT"),
        help="every prompt IN tokens, every output OUT tokens (--num-seqs: default 1)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        help=f"attention kernels (sets {ATTENTION_ENV}; default: the platform's choice)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--num-kvcache-blocks", type=int, default=None)
    parser.add_argument("--json", default=None, help="write a JSON record here")
    parser.add_argument("--eviction-policy", default="lru", choices=sorted(POLICIES))
    parser.add_argument("--block-size", type=int, default=None, help="kvcache_block_size")
    parser.add_argument(
        "--compile-at-startup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the whole ladder first (--no-compile-at-startup: as steps need them, "
        "for quick CPU runs; the timings then include compilation)",
    )
    parser.add_argument(
        "--num-scheduler-steps",
        type=int,
        help="decode steps per executable when few sequences run (default: the platform's)",
    )
    parser.add_argument("--logprobs", type=int, help="every request's logprobs (top tokens)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    parser.add_argument(
        "--json-schema",
        nargs="?",
        const="bench",
        choices=sorted(SCHEMAS),
        help="every request's output follows a JSON schema (structured outputs): BENCH_SCHEMA "
        "(the default) or TEXT_SCHEMA",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --fixed-lengths: run it this many times, run i on prompts of seed i, and "
        "record the run of median throughput (every run's in runs_tok_s)",
    )
    workload_flags = add_workload_arguments(parser, required=False)
    args = parser.parse_args(argv)
    if args.repeat < 1 or (args.repeat > 1 and not args.fixed_lengths) or args.repeat % 2 == 0:
        parser.error(
            "--repeat takes an odd count (its median run is recorded), more than 1 only "
            "with --fixed-lengths"
        )
    stray = [f for f, dest in workload_flags if getattr(args, dest) != parser.get_default(dest)]
    if stray and not args.workload:
        parser.error(f"{', '.join(stray)} apply to a --workload only")
    if args.fixed_lengths and (args.max_input_len or args.max_output_len):
        parser.error("--max-input-len and --max-output-len do not apply to --fixed-lengths")
    if args.num_seqs is not None and args.num_seqs < 1:
        parser.error("--num-seqs must be at least 1")
    if args.fixed_lengths and min(args.fixed_lengths) < 1:
        parser.error("--fixed-lengths takes two lengths of at least 1 token")
    ignored = [
        flag for flag in WORKLOAD_IGNORES if getattr(args, flag[2:].replace("-", "_")) is not None
    ]
    if args.workload and ignored:
        parser.error(f"{', '.join(ignored)} do not apply to a --workload: it runs whole")
    try:
        check_output("--json", args.json)
    except ValueError as error:
        parser.error(str(error))
    requests = None
    if args.workload:
        try:
            requests = workload_from_arguments(args)
        except (OSError, ValueError) as error:  # a --trace file missing or malformed
            parser.error(str(error))
        if not requests:
            parser.error("the workload has no requests")
        if any(request.arrival_time is not None for request in requests):
            parser.error("the workload has arrival times; bench.py runs every request at once")
    for flag in ("--max-input-len", "--max-output-len"):
        if (value := getattr(args, flag[2:].replace("-", "_"))) is not None and value < MIN_LEN:
            parser.error(f"{flag} must be at least {MIN_LEN}: nano-vllm's lengths run from it")

    start = time.perf_counter()
    import jax

    from jaxllm import LLM, SamplingParams, StructuredOutputsParams
    from jaxllm.startup import DEFAULT_MAX_MODEL_LEN

    if args.attention:
        os.environ[ATTENTION_ENV] = args.attention
    on_accelerator = Platform.detect().backend != "cpu"
    if on_accelerator:
        model = args.model or "random:qwen3-0.6b"
        num_seqs, max_in, max_out = 256, 1024, 1024
        engine_kwargs = {}
    else:
        model = args.model or "random:qwen3-tiny"
        num_seqs, max_in, max_out = 16, 256, 128
        engine_kwargs = {"max_num_seqs": 16, "max_model_len": 512, "max_num_batched_tokens": 2048}
        print("No accelerator: a small workload on the CPU, not nano-vllm's.")
    num_seqs = args.num_seqs or num_seqs
    max_in = args.max_input_len or max_in
    max_out = args.max_output_len or max_out
    if requests:
        prompts = [r.prompt_token_ids.tolist() for r in requests]
        max_tokens = [r.max_tokens for r in requests]
        num_seqs = len(requests)
    elif args.fixed_lengths:
        num_seqs = args.num_seqs or 1
        prompts, max_tokens = fixed_workload(num_seqs, *args.fixed_lengths)
    else:
        prompts, max_tokens = workload(num_seqs, max_in, max_out)
    longest = max(len(prompt) + n for prompt, n in zip(prompts, max_tokens, strict=True))
    if longest > engine_kwargs.get("max_model_len", DEFAULT_MAX_MODEL_LEN):  # else the default
        engine_kwargs["max_model_len"] = longest
    if args.block_size is not None:
        engine_kwargs["kvcache_block_size"] = args.block_size

    # NOTE: a workload's identical prompts sample identical outputs (seeded by their tokens), as
    # the simulator, whose predictions the record holds, assumes.
    seeds = metadatas = [None] * len(prompts)
    if requests:
        seeds = [xxhash.xxh3_64_intdigest(np.asarray(p, np.int32).tobytes()) for p in prompts]
        metadatas = [request.metadata for request in requests]
    schema = SCHEMAS[args.json_schema] if args.json_schema else None
    try:  # what the flags alone decide is refused before the engine starts
        # NOTE: no free whitespace, which random weights would fill most tokens with
        structured = None
        if schema is not None:
            structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        params = [
            SamplingParams(
                temperature=0.6,
                ignore_eos=True,
                max_tokens=n,
                seed=seed,
                logprobs=args.logprobs,
                repetition_penalty=args.repetition_penalty,
                structured_outputs=structured,
                extra_args=metadata,
            )
            for n, seed, metadata in zip(max_tokens, seeds, metadatas, strict=True)
        ]
        llm = LLM(
            model,
            tensor_parallel_size=args.tp,
            enable_prefix_caching=not args.no_prefix_caching,
            num_kvcache_blocks=args.num_kvcache_blocks,
            eviction_policy=args.eviction_policy,
            compile_at_startup=args.compile_at_startup,
            num_scheduler_steps=args.num_scheduler_steps,
            max_logprobs=max(args.logprobs or 0, 20),
            **engine_kwargs,
        )
    except (OSError, TypeError, ValueError) as error:  # a value out of range, a missing model
        parser.error(str(error))
    if longest > llm.config.max_model_len:  # NOTE: the engine would cut the outputs short
        parser.error(f"requests of {longest} tokens; the model takes {llm.config.max_model_len}")
    startup_s = time.perf_counter() - start
    # NOTE: a workload's warm-up leaves no block in the prefix cache (3 + 1 tokens), so the
    # run starts from the state the simulator assumes.
    warmup_tokens = 1 if requests else SamplingParams().max_tokens
    # NOTE: with the run's settings, so that what they first compile is compiled here.
    warmup = dataclasses.replace(params[0], max_tokens=warmup_tokens)
    llm.generate(["Benchmark: "], warmup, use_tqdm=False)

    compilations, built_before = count_compilations(), llm.engine.runner.num_executables
    stats_before = llm.cache_stats()
    preemptions_before = llm.engine.scheduler.num_preemptions
    runs = []
    for run in range(args.repeat):
        if run:  # prompts of their own: no run reads another's prefix cache
            prompts, _ = fixed_workload(num_seqs, *args.fixed_lengths, seed=run)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        total = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")
        runs.append((total / elapsed, elapsed, total, llm.last_run_stats, outputs))
    _, elapsed, total, stats, outputs = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    device = jax.devices()[0].device_kind
    # NOTE: the ceilings are an H200's; a workload's cached prefixes are outside the model
    bound = None
    if "H200" in device and requests is None:
        lengths, dtype_bytes = [len(p) for p in prompts], llm.model_config.jnp_dtype.itemsize
        bound = physical_bound(
            llm.model_config, lengths, max_tokens, args.tp, dtype_bytes=dtype_bytes
        )
    record = {
        "model": model,
        "fixed_lengths": args.fixed_lengths,
        "tp": args.tp,
        "num_scheduler_steps": llm.engine.config.num_scheduler_steps,
        "logprobs": args.logprobs,
        "repetition_penalty": args.repetition_penalty,
        "json_schema": args.json_schema,
        "num_seqs": num_seqs,
        "output_tokens": total,
        "time_s": elapsed,
        "throughput_tok_s": total / elapsed,
        "runs_tok_s": [run[0] for run in runs],
        "prefill_tok_s": stats.get("prefill_tok_s"),
        "decode_tok_s": stats.get("decode_tok_s"),
        "prefill_steps": stats.get("prefill_steps"),
        "decode_steps": stats.get("decode_steps"),
        "decode_ms_per_step": stats.get("decode_ms_per_step"),  # NOTE: per plan
        "decode_forward_passes": stats.get("decode_forward_passes"),
        "decode_ms_per_forward_pass": stats.get("decode_ms_per_forward_pass"),
        "decode_dispatch_ms_per_step": stats.get("decode_dispatch_ms_per_step"),
        "decode_wait_ms_per_step": stats.get("decode_wait_ms_per_step"),
        "decode_masks_ms_per_step": stats.get("decode_masks_ms_per_step"),
        "decode_masks_late_steps": stats.get("decode_masks_late_steps"),
        "startup_s": startup_s,
        "compile_s": llm.compile_seconds,
        "startup_phases_s": llm.startup_seconds,
        "num_executables": llm.num_executables,
        "compilations_during_run": len(compilations),
        # built or loaded from jaxllm's store of executables (which JAX does not count)
        "executables_built_during_run": llm.engine.runner.num_executables - built_before,
        "num_kvcache_blocks": llm.num_kvcache_blocks,
        "attention_kernels": dataclasses.asdict(llm.kernels),
        "device": device,
        "jax_version": jax.__version__,
        "bound_tok_s": bound and bound["bound_tok_per_s"],
        "bound_ratio": bound and (total / elapsed) / bound["bound_tok_per_s"],
    }
    if requests is not None:
        record |= workload_record(
            args, requests, llm, outputs, elapsed, stats_before, preemptions_before
        )
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
