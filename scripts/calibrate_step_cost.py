"""Fit the simulator's step cost model to the engine's timed steps, and check it on a timed trace.

    # time a spread of step shapes, fit, write the model
    python scripts/calibrate_step_cost.py measure --model random:qwen3-0.6b --out step_cost.json
    # a timed trace through the engine and through the simulator: TTFT of both (fits first
    # without --cost-model, on the phases and on --calibration-requests of another seed)
    python scripts/calibrate_step_cost.py replay --model random:qwen3-0.6b \
        --calibration-requests 500 --num-requests 1000 --request-rate 20
    # the simulator alone on a trace (no model, no device)
    python scripts/calibrate_step_cost.py simulate --trace trace.jsonl --cost-model step_cost.json

Without an accelerator the engine defaults to random:qwen3-tiny with small limits
(docs/cache-policies.md, "Time that depends on the work").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from cache_sim import policy_from_spec  # scripts/cache_sim.py

from jaxllm.research import calibrate
from jaxllm.research.cache_sim import format_table, make_config, simulate
from jaxllm.research.cost_model import H200_QWEN3_0_6B, StepCostModel
from jaxllm.research.flags import check_output
from jaxllm.research.mooncake import add_trace_arguments, trace_from_arguments, write_jsonl
from jaxllm.research.workloads import Request, load_trace

# The engine's limits without an accelerator: a small ladder, compiled at start-up so that no
# timed step compiles.
CPU_ENGINE_KWARGS = {
    "max_num_seqs": 8,
    "max_model_len": 256,
    "max_num_batched_tokens": 256,
    "kvcache_block_size": 16,
    "compile_at_startup": True,
}
ENGINE_FLAGS = {
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "kvcache_block_size",
    "num_kvcache_blocks": "num_kvcache_blocks",
    "num_scheduler_steps": "num_scheduler_steps",
    "compile_at_startup": "compile_at_startup",
    "eviction_policy": "eviction_policy",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine (default: the engine's; small ones on a CPU)")
    engine.add_argument("--model", default=None, help="default: random:qwen3-0.6b on a GPU")
    for flag in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size"):
        engine.add_argument("--" + flag.replace("_", "-"), type=int, default=None)
    engine.add_argument("--num-kvcache-blocks", type=int, default=None)
    engine.add_argument("--num-scheduler-steps", type=int, default=None)
    engine.add_argument("--compile-at-startup", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--eviction-policy", default=None)
    calibration = parser.add_argument_group("calibration")
    calibration.add_argument("--decode-steps", type=int, default=32, help="per decode phase")
    calibration.add_argument("--repeats", type=int, default=3, help="prefill phases per size")
    calibration.add_argument("--out", default=None, help="write the fitted model here (JSON)")
    calibration.add_argument("--samples", default=None, help="write the timed steps here (JSON)")


def add_trace_source_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default=None, help="a JSONL trace (workloads.load_trace)")
    add_trace_arguments(parser, num_requests=200, request_rate=20.0, num_prefixes=20)


def trace_requests(args: argparse.Namespace) -> list[Request]:
    """The requests of --trace, or of a synthetic trace written to a temporary file."""
    options = {"hash_block_size": args.hash_block_size, "seed": args.seed}
    if args.trace:
        return load_trace(args.trace, **options)
    records = trace_from_arguments(args)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.jsonl"
        write_jsonl(path, records)
        return load_trace(path, **options)


START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


def engine_settings(args: argparse.Namespace) -> tuple[str, dict]:
    """The model and `LLM`'s arguments the flags ask for on this machine."""
    from jaxllm.platform import Platform

    gpu = Platform.detect().backend != "cpu"
    model = args.model or ("random:qwen3-0.6b" if gpu else "random:qwen3-tiny")
    kwargs = {} if gpu else dict(CPU_ENGINE_KWARGS)
    for flag, name in ENGINE_FLAGS.items():
        if getattr(args, flag) is not None:
            kwargs[name] = getattr(args, flag)
    return model, kwargs


def build_llm(args: argparse.Namespace):
    from jaxllm import LLM

    model, kwargs = engine_settings(args)
    llm = LLM(model, **kwargs)
    progress(f"engine built: {model}, {llm.engine.scheduler.config}")
    return model, llm


def fitted_model(args: argparse.Namespace, model_name: str, llm) -> tuple[StepCostModel, dict]:
    """Times the calibration phases on the engine (and, with --calibration-requests, a trace
    like the replayed one with the next seed), fits the model, writes --out and --samples."""
    import jax

    phase_options = {"decode_steps": args.decode_steps, "repeats": args.repeats}
    samples = calibrate.measure(llm.engine, **phase_options)
    if getattr(args, "calibration_requests", 0):
        options = {"num_requests": args.calibration_requests, "seed": args.seed + 1}
        requests = trace_requests(argparse.Namespace(**vars(args) | options))
        llm.engine.reset()
        samples += calibrate.run_timed(llm.engine, requests).samples
    progress(f"calibration: {len(samples)} steps timed")
    device = jax.devices()[0].device_kind
    description = f"fit: {model_name} on {device}, {len(samples)} steps"
    model = StepCostModel.fit(samples, description=description)
    report = calibrate.fit_report(model, samples)
    if args.out:
        model.save(args.out)
    if args.samples:
        rows = [work._asdict() | {"seconds": seconds} for work, seconds in samples]
        Path(args.samples).write_text(json.dumps(rows) + "\n")
    return model, report


def run_measure(args: argparse.Namespace) -> dict:
    model_name, llm = build_llm(args)
    model, report = fitted_model(args, model_name, llm)
    return {"cost_model": model.as_dict(), "fit": report}


def read_inputs(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[StepCostModel | None, list[Request]]:
    """--policy, --cost-model and the trace of `replay` or `simulate`, read before anything
    runs: a usage error where one is bad, or where a replay's trace is too long for the
    max_model_len its flags give (on a CPU always)."""
    try:
        if args.command == "simulate":
            args.policy = policy_from_spec(args.policy)
        model = StepCostModel.load(args.cost_model) if args.cost_model else None
        start = time.perf_counter()
        requests = trace_requests(args)
    except (ValueError, ImportError, AttributeError, OSError) as error:
        parser.error(str(error))
    args.load_seconds = time.perf_counter() - start
    if args.command == "replay":
        # NOTE: the engine's default max_model_len follows from the model: checked once built.
        limit = engine_settings(args)[1].get("max_model_len")
        if limit is not None:
            check_prompts_fit(parser, requests, limit)
    return model, requests


def check_prompts_fit(parser: argparse.ArgumentParser, requests: list[Request], limit: int) -> None:
    """A usage error where a prompt of the trace is too long for the engine's max_model_len."""
    longest = max(request.num_prompt_tokens for request in requests)
    if longest >= limit:
        parser.error(
            f"the trace's longest prompt has {longest} tokens; max_model_len is {limit} "
            "(--max-model-len, or a smaller --hash-block-size)"
        )


def run_replay(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    model: StepCostModel | None,
    requests: list[Request],
) -> dict:
    model_name, llm = build_llm(args)
    check_prompts_fit(parser, requests, llm.engine.scheduler.config.max_model_len)
    if model is not None:
        report = None
        phase_options = {"decode_steps": args.decode_steps, "repeats": args.repeats}
        calibrate.warm_up(llm.engine, **phase_options)
        progress("warmed up")
    else:
        model, report = fitted_model(args, model_name, llm)
    last = max(request.arrival_time or 0.0 for request in requests)
    progress(f"replaying {len(requests)} requests arriving over {last:.1f} s")
    record = calibrate.replay(llm.engine, requests, model) | {"fit": report}
    progress("replayed through the engine and the simulator")
    engine, simulator = record["engine_ttft_seconds"], record["simulator_ttft_seconds"]
    print(
        "TTFT mean / p50 / p99 (s): engine {mean:.4f} / {p50:.4f} / {p99:.4f}".format(**engine)
        + ", simulator {mean:.4f} / {p50:.4f} / {p99:.4f}".format(**simulator)
    )
    ratio = record["ttft_ratio"]["mean"]
    verdict = "within" if abs(ratio - 1) <= 0.2 else "NOT within"
    print(f"simulator / engine mean TTFT: {ratio:.3f} ({verdict} 20%)")
    return record


def run_simulate(
    args: argparse.Namespace, model: StepCostModel | None, requests: list[Request]
) -> dict:
    model = model or H200_QWEN3_0_6B
    config = make_config(
        requests,
        args.cache_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_tile=args.prefill_tile,
    )
    config = dataclasses.replace(config, num_scheduler_steps=args.num_scheduler_steps)
    policy = args.policy() if isinstance(args.policy, type) else args.policy
    result = simulate(requests, config, policy, arrival="time", cost_model=model)
    print(format_table([result]))
    print(
        f"{len(requests)} requests: loaded in {args.load_seconds:.1f} s, simulated in "
        f"{result.wall_seconds:.1f} s; TTFT mean / p50 / p99 {result.mean_ttft_seconds:.4f} / "
        f"{result.p50_ttft_seconds:.4f} / {result.p99_ttft_seconds:.4f} s; cost model: "
        f"{model.description}"
    )
    return result.as_dict() | {"load_seconds": args.load_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="calibrate_step_cost.py", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    measure = commands.add_parser("measure", help="time step shapes on the engine and fit")
    add_engine_arguments(measure)
    replay = commands.add_parser("replay", help="a timed trace: engine vs simulator TTFT")
    add_engine_arguments(replay)
    replay.add_argument("--cost-model", default=None, help="default: measure and fit first")
    replay.add_argument(
        "--calibration-requests", type=int, default=0,
        help="fit also on a trace of this many requests like the replayed one (the next seed)",
    )  # fmt: skip
    add_trace_source_arguments(replay)
    sim = commands.add_parser("simulate", help="the simulator alone on a timed trace")
    sim.add_argument("--cost-model", default=None, help="default: the H200 0.6B fit")
    settings = sim.add_argument_group("scheduler (default: the engine's on one H200, 0.6B)")
    settings.add_argument("--cache-blocks", type=int, default=3392, help="KV blocks")
    settings.add_argument("--block-size", type=int, default=256)
    settings.add_argument("--max-num-seqs", type=int, default=512)
    settings.add_argument("--max-num-batched-tokens", type=int, default=16384)
    settings.add_argument("--prefill-tile", type=int, default=128)
    settings.add_argument("--num-scheduler-steps", type=int, default=1)
    settings.add_argument("--policy", default="lru", help="a name, or module:Class")
    add_trace_source_arguments(sim)
    for command in (measure, replay, sim):
        command.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    try:
        for flag in ("--json", "--out", "--samples"):
            check_output(flag, getattr(args, flag[2:], None))
    except ValueError as error:
        parser.error(str(error))
    if args.command == "measure":
        record = run_measure(args)
    else:
        model, requests = read_inputs(parser, args)
        if args.command == "replay":
            record = run_replay(parser, args, model, requests)
        else:
            try:  # NOTE: the simulator refuses settings too small for the trace, as ValueErrors
                record = run_simulate(args, model, requests)
            except ValueError as error:
                parser.error(str(error))
    if args.command != "simulate":
        print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
