"""Synthetic request traces in Mooncake's JSONL format (pure Python + numpy, no download).

A record is {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]},
one hash id per block of `MOONCAKE_BLOCK_SIZE` tokens, equal ids meaning equal blocks;
`workloads.load_trace` turns it into a `Request`. Each prompt is one of `num_prefixes` shared
prefixes, drawn with Zipf popularity, then blocks of its own; arrivals are a Poisson process.

    python -m jaxllm.research.mooncake trace.jsonl --num-requests 100000 --request-rate 20
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jaxllm.research.workloads import MOONCAKE_BLOCK_SIZE


def synthetic_trace(
    num_requests: int = 1000,
    *,
    num_prefixes: int = 100,
    prefix_blocks: tuple[int, int] = (1, 4),
    own_blocks: tuple[int, int] = (1, 2),
    output_length: tuple[int, int] = (16, 128),
    zipf_exponent: float = 1.0,
    request_rate: float = 10.0,
    hash_block_size: int = MOONCAKE_BLOCK_SIZE,
    seed: int = 0,
) -> list[dict]:
    """Mooncake-format records of `num_requests` requests, in arrival order.

    Args:
        num_prefixes: shared prefixes; prefix k (0-based) has a length drawn uniformly from
            `prefix_blocks` (inclusive, in hash blocks) and is drawn with probability
            proportional to 1 / (k + 1)**zipf_exponent (0: uniformly).
        own_blocks: blocks of its own each prompt adds (inclusive range, at least 1); its last
            block is partial (1 to hash_block_size tokens), as in Mooncake's traces.
        output_length: tokens to generate, drawn uniformly (inclusive).
        request_rate: requests per second of the Poisson arrivals; the first arrives at 0 ms.

    Returns:
        dicts with integer "timestamp" (ms), "input_length", "output_length" and "hash_ids".
    """
    spans = {
        "prefix_blocks": (prefix_blocks, 0),
        "own_blocks": (own_blocks, 1),
        "output_length": (output_length, 1),
    }
    problems = [
        f"{name} must be (low, high) with {least} <= low <= high, got {span!r}"
        for name, (span, least) in spans.items()
        if not (len(span) == 2 and least <= span[0] <= span[1])
    ]
    counts = {
        "num_requests": num_requests,
        "num_prefixes": num_prefixes,
        "hash_block_size": hash_block_size,
    }
    problems += [f"{name} must be >= 1, got {n!r}" for name, n in counts.items() if n < 1]
    if not 0 < request_rate < np.inf:
        problems.append(f"request_rate must be a finite number > 0, got {request_rate!r}")
    if problems:
        raise ValueError("; ".join(problems))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prefix_blocks[0], prefix_blocks[1] + 1, num_prefixes)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    next_id = int(starts[-1])  # ids below it belong to the prefixes
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** zipf_exponent
    prefixes = rng.choice(num_prefixes, size=num_requests, p=weights / weights.sum())
    owns = rng.integers(own_blocks[0], own_blocks[1] + 1, num_requests)
    last_block = rng.integers(1, hash_block_size + 1, num_requests)  # tokens of the last block
    outputs = rng.integers(output_length[0], output_length[1] + 1, num_requests)
    gaps = rng.exponential(1000.0 / request_rate, num_requests)
    timestamps = np.cumsum(gaps) - gaps[0]
    records = []
    for index in range(num_requests):
        prefix, own = int(prefixes[index]), int(owns[index])
        hash_ids = [*range(starts[prefix], starts[prefix + 1]), *range(next_id, next_id + own)]
        next_id += own
        input_length = (len(hash_ids) - 1) * hash_block_size + int(last_block[index])
        records.append(
            {
                "timestamp": int(timestamps[index]),
                "input_length": input_length,
                "output_length": int(outputs[index]),
                "hash_ids": [int(h) for h in hash_ids],
            }
        )
    return records


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """One JSON object per line."""
    with open(path, "w") as file:
        for record in records:
            file.write(json.dumps(record) + "\n")


def add_trace_arguments(
    parser, num_requests: int = 1000, request_rate: float = 10.0, num_prefixes: int = 100
) -> None:
    """The command-line arguments of `synthetic_trace` (`trace_from_arguments`)."""
    trace = parser.add_argument_group("synthetic trace (Mooncake's format)")
    trace.add_argument("--num-requests", type=int, default=num_requests)
    trace.add_argument("--request-rate", type=float, default=request_rate)
    trace.add_argument("--num-prefixes", type=int, default=num_prefixes)
    trace.add_argument("--prefix-blocks", type=int, nargs=2, default=(1, 4))
    trace.add_argument("--own-blocks", type=int, nargs=2, default=(1, 2))
    trace.add_argument("--output-length", type=int, nargs=2, default=(16, 128))
    trace.add_argument("--zipf", type=float, default=1.0)
    trace.add_argument("--hash-block-size", type=int, default=MOONCAKE_BLOCK_SIZE)
    trace.add_argument("--seed", type=int, default=0)


def trace_from_arguments(args: argparse.Namespace) -> list[dict]:
    """The records of `synthetic_trace` for the arguments of `add_trace_arguments`."""
    return synthetic_trace(
        args.num_requests,
        num_prefixes=args.num_prefixes,
        prefix_blocks=tuple(args.prefix_blocks),
        own_blocks=tuple(args.own_blocks),
        output_length=tuple(args.output_length),
        zipf_exponent=args.zipf,
        request_rate=args.request_rate,
        hash_block_size=args.hash_block_size,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxllm.research.mooncake",
        description="Write a synthetic trace in Mooncake's JSONL format.",
    )
    parser.add_argument("path")
    add_trace_arguments(parser)
    args = parser.parse_args(argv)
    try:
        records = trace_from_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    write_jsonl(args.path, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
