"""The prefix-cache simulator's command line: a workload through the scheduler and the block pool
for each eviction policy and cache size, without a model (docs/cache-policies.md).

    python scripts/cache_sim.py --workload shared-prefix --groups 64 --prompts-per-group 16 \
        --prefix-len 2048 --cache-blocks 256,512,1024 --plot hit_rate.png

Prints a table; --csv, --json and --plot (a PNG, needs matplotlib) write the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time

from jaxllm.cache.eviction import EvictionPolicy, make_policy
from jaxllm.research.cache_sim import (
    POLICY_NAMES,
    default_cache_sizes,
    format_table,
    make_config,
    plot,
    sweep,
    write_csv,
    write_json,
)
from jaxllm.research.flags import check_output
from jaxllm.research.workloads import add_workload_arguments, workload_from_arguments


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item]


def policy_from_spec(spec: str) -> str | type[EvictionPolicy]:
    """A policy name, or "module:Class" for a policy class of your own (the module found from
    the current directory too), checked to make a policy.

    Raises:
        ValueError, ImportError, AttributeError: naming what cannot be made.
    """
    policy: str | type = spec
    if ":" in spec:
        import importlib

        if os.getcwd() not in sys.path:  # NOTE: a script's own folder is on it, not the caller's
            sys.path.append(os.getcwd())
        module, name = spec.split(":", 1)
        policy = getattr(importlib.import_module(module), name)
        if not (isinstance(policy, type) and issubclass(policy, EvictionPolicy)):
            raise ValueError(f"{spec} is not an EvictionPolicy subclass")
    try:
        make_policy(policy) if isinstance(policy, str) else policy()
    except TypeError as error:  # an abstract class, or one that takes arguments
        raise ValueError(f"{policy.__name__}() cannot be made: {error}") from None
    return policy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cache_sim.py",
        description="Replay a workload through the scheduler and the block pool (no model) for "
        "each eviction policy and cache size; print a table, write CSV / JSON / a PNG plot.",
    )
    add_workload_arguments(parser)
    sim = parser.add_argument_group("simulation (defaults: the engine's on a GPU)")
    sim.add_argument(
        "--policies",
        default=",".join(POLICY_NAMES),
        help="comma-separated names, or module:Class for a policy of your own",
    )
    sim.add_argument(
        "--cache-blocks", type=_int_list, default=None, help="comma-separated sizes in blocks"
    )
    sim.add_argument("--block-size", type=int, default=256)
    sim.add_argument("--max-num-seqs", type=int, default=512)
    sim.add_argument("--max-num-batched-tokens", type=int, default=16384)
    sim.add_argument("--prefill-tile", type=int, default=128)
    sim.add_argument("--max-model-len", type=int, default=None, help="default: the longest")
    sim.add_argument("--no-prefix-caching", action="store_true")
    sim.add_argument("--arrival", choices=["order", "time"], default="order")
    sim.add_argument("--step-time", type=float, default=0.0, help="seconds per step")
    sim.add_argument("--csv", default=None)
    sim.add_argument("--json", default=None)
    sim.add_argument("--plot", default=None, help="a PNG: hit rate against cache size")
    sim.add_argument("--metric", choices=["prompt_hit_rate", "hit_rate"], default=None)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    # NOTE: everything the flags decide is checked before the first simulation.
    try:
        if args.block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {args.block_size}")
        if not 0 <= args.step_time < math.inf:
            raise ValueError(f"--step-time must be a finite number >= 0, got {args.step_time}")
        for flag in ("csv", "json", "plot"):
            check_output(f"--{flag}", getattr(args, flag))
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install -e '.[plots]'")
        requests = workload_from_arguments(args)
        generate_seconds = time.perf_counter() - start
        if not requests:
            raise ValueError("the workload has no requests")
        config = make_config(
            requests,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_tile=args.prefill_tile,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        sizes = args.cache_blocks or default_cache_sizes(requests, args.block_size)
        if min(sizes) < 1:
            raise ValueError(f"--cache-blocks takes sizes of at least 1 block, got {sizes}")
        smallest = dataclasses.replace(config, num_blocks=min(sizes))
        for request in requests:  # each fits the smallest cache and max_model_len
            smallest.check_request(request.prompt_token_ids, request.max_tokens)
        policies = [policy_from_spec(name) for name in args.policies.split(",") if name]
        if not policies:
            raise ValueError(f"--policies names no policy: {args.policies!r}")
    except (ValueError, ImportError, AttributeError, OSError) as error:
        parser.error(str(error))
    print(
        f"{args.workload}: {len(requests)} requests, "
        f"{sum(r.num_prompt_tokens for r in requests)} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens (generated in "
        f"{generate_seconds:.2f} s); cache sizes {sizes} blocks of {args.block_size}"
    )
    results = sweep(
        requests, config, policies, sizes, arrival=args.arrival, step_time=args.step_time
    )
    print(format_table(results))
    print(f"simulated in {sum(r.wall_seconds for r in results):.2f} s")
    if args.csv:
        write_csv(results, args.csv)
    if args.json:
        write_json(results, args.json, workload=vars(args) | {"cache_blocks": sizes})
    if args.plot:
        title = f"{args.workload}, {len(requests)} requests, block {args.block_size}"
        plot(results, args.plot, title, metric=args.metric or "prompt_hit_rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
