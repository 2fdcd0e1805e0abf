"""Seeded request workloads for prefix-cache experiments (pure Python + numpy, no jax).

Each generator returns a list of `Request`s (prompt token ids, max_tokens, optional arrival
time) that `cache_sim.simulate` replays through the scheduler and the block pool, and
`scripts/bench.py --workload ...` runs through the engine. Prompts are random token ids below
`vocab_size`, so two blocks are equal only where a workload means them to be.

- `shared_prefix`: groups of prompts that share a system prompt (SGLang's
  generated-shared-prefix benchmark).
- `multi_turn_chat`: each turn's prompt is the whole conversation so far plus a new message;
  conversations interleaved round robin, so a conversation's reuse distance is long.
- `prefix_repetition`: every request starts with one of N prefixes drawn at random (uniform
  or Zipf), then a suffix of its own (vLLM's prefix-repetition dataset).
- `hot_prefix_with_scans`: one hot prefix reused all the time, one-off prompts between its
  uses, and now and then a scan of one-off prompts; built to tell LRU, FIFO, LFU and MRU apart
  (docs/cache-policies.md).
- `load_trace` / `save_trace`: JSONL traces (token ids, or Mooncake-style per-block hash ids).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

DEFAULT_VOCAB_SIZE = 10_000  # nano-vllm's benchmark draws token ids below 10,000
MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces


@dataclass(frozen=True, eq=False)
class Request:
    """One request of a workload.

    Attributes:
        prompt_token_ids: [N] int32 token ids, N >= 1.
        max_tokens: tokens to generate (workloads are run with ignore_eos, so exactly these).
        arrival_time: seconds from the start of the workload; None: arrives with the others.
        metadata: what the request says of itself (`SamplingParams.extra_args`: a session, a
            priority, a tenant), which eviction policies may read; None: nothing.
    """

    prompt_token_ids: np.ndarray
    max_tokens: int
    arrival_time: float | None = None
    metadata: dict | None = None

    def __post_init__(self) -> None:
        prompt = np.asarray(self.prompt_token_ids)
        if prompt.ndim != 1 or not prompt.size or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError("prompt_token_ids must be a non-empty 1-d array of token ids")
        if not 0 <= prompt.min() <= prompt.max() < 2**31:
            raise ValueError("prompt_token_ids must be in [0, 2**31)")
        object.__setattr__(self, "prompt_token_ids", prompt.astype(np.int32, copy=False))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int | np.integer):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        arrival = self.arrival_time
        if arrival is not None and not (math.isfinite(arrival) and arrival >= 0):
            raise ValueError(f"arrival_time must be a finite number >= 0, got {arrival!r}")
        if self.metadata is not None and not isinstance(self.metadata, dict):
            raise ValueError(f"metadata must be an object, got {self.metadata!r}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _tokens(rng: np.random.Generator, count: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, count, dtype=np.int32)


def shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    prefix_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    *,
    order: str = "grouped",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Request]:
    """Groups of prompts sharing a system prompt: each prompt is its group's `prefix_len`
    tokens followed by a question of `question_len` tokens of its own.

    Args:
        order: "grouped" (group by group, SGLang's order), "interleaved" (round robin over the
            groups: the first prompt of each group, then the second, ...) or "shuffled".

    Returns:
        num_groups * prompts_per_group requests of prefix_len + question_len tokens, each with
        max_tokens = output_len.
    """
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    grid = [
        [
            Request(np.concatenate([prefix, _tokens(rng, question_len, vocab_size)]), output_len)
            for _ in range(prompts_per_group)
        ]
        for prefix in prefixes
    ]
    if order == "grouped":
        return [request for group in grid for request in group]
    if order == "interleaved":
        return [grid[g][p] for p in range(prompts_per_group) for g in range(num_groups)]
    if order == "shuffled":
        requests = [request for group in grid for request in group]
        return [requests[i] for i in rng.permutation(len(requests))]
    raise ValueError(f"order must be 'grouped', 'interleaved' or 'shuffled', got {order!r}")


def multi_turn_chat(
    num_conversations: int = 64,
    num_turns: int = 8,
    system_len: int = 512,
    user_len: int = 64,
    output_len: int = 128,
    *,
    shared_system_prompt: bool = True,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Request]:
    """Conversations replayed turn by turn, interleaved round robin (turn 1 of every
    conversation, then turn 2, ...), so each conversation comes back after all the others.

    Turn t's prompt is the system prompt, then t user messages of `user_len` tokens with the
    t - 1 assistant replies of `output_len` tokens between them; it asks for `output_len`
    tokens. The replies in later prompts are the recorded ones (random tokens fixed by the
    seed), not what a model generates, as when replaying a chat dataset: so a turn reuses the
    previous turn's *prompt* blocks, never the blocks of its generated tokens.

    Args:
        shared_system_prompt: one system prompt for all conversations, or one each.

    Returns:
        num_conversations * num_turns requests.
    """
    rng = np.random.default_rng(seed)
    shared = _tokens(rng, system_len, vocab_size)
    turns: list[list[Request]] = []
    for _ in range(num_conversations):
        context = shared if shared_system_prompt else _tokens(rng, system_len, vocab_size)
        conversation = []
        for turn in range(num_turns):
            if turn:
                context = np.concatenate([context, _tokens(rng, output_len, vocab_size)])
            context = np.concatenate([context, _tokens(rng, user_len, vocab_size)])
            conversation.append(Request(context, output_len))
        turns.append(conversation)
    return [turns[c][t] for t in range(num_turns) for c in range(num_conversations)]


def prefix_repetition(
    num_requests: int = 1024,
    num_prefixes: int = 16,
    prefix_len: int = 1024,
    suffix_len: int = 128,
    output_len: int = 128,
    *,
    zipf_exponent: float = 0.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Request]:
    """Each request is one of `num_prefixes` prefixes, drawn at random, plus a suffix of its own.

    Args:
        zipf_exponent: 0 draws the prefixes uniformly; s > 0 draws prefix k (0-based) with
            probability proportional to 1 / (k + 1)**s, so a few prefixes are hot.
        suffix_len: 0 makes requests with the same prefix identical.
    """
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** zipf_exponent
    choices = rng.choice(num_prefixes, size=num_requests, p=weights / weights.sum())
    return [
        Request(np.concatenate([prefixes[k], _tokens(rng, suffix_len, vocab_size)]), output_len)
        for k in choices
    ]


def hot_prefix_with_scans(
    num_rounds: int = 8,
    requests_per_round: int = 24,
    scan_len: int = 8,
    prefix_len: int = 16,
    suffix_len: int = 1,
    output_len: int = 1,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Request]:
    """A workload that separates the eviction policies: one hot prefix, one-off prompts
    between its uses, and a scan of one-off prompts at the end of every round.

    A round is `requests_per_round` requests alternating the hot prefix and a one-off prompt
    (hot, one-off, hot, one-off, ...), then `scan_len` one-off prompts in a row. Every request
    is `prefix_len` tokens (the hot prefix, or a prefix of its own) plus `suffix_len` tokens of
    its own. With `prefix_len` one block, `suffix_len` < one block and `output_len` 1, each
    request leaves exactly one cached block behind, so a cache of C + 1 blocks (one for the
    running request's partial block) is a cache of C entries and the hit counts follow from the
    policy alone; docs/cache-policies.md works them out.
    """
    rng = np.random.default_rng(seed)
    hot = _tokens(rng, prefix_len, vocab_size)

    def one_off() -> np.ndarray:
        return _tokens(rng, prefix_len, vocab_size)

    requests = []
    for _ in range(num_rounds):
        for index in range(requests_per_round):
            prefix = hot if index % 2 == 0 else one_off()
            requests.append(
                Request(np.concatenate([prefix, _tokens(rng, suffix_len, vocab_size)]), output_len)
            )
        for _ in range(scan_len):
            requests.append(
                Request(
                    np.concatenate([one_off(), _tokens(rng, suffix_len, vocab_size)]), output_len
                )
            )
    return requests


def with_poisson_arrivals(
    requests: Sequence[Request], request_rate: float, *, seed: int = 0
) -> list[Request]:
    """The same requests, arriving as a Poisson process of `request_rate` requests a second."""
    if not (math.isfinite(request_rate) and request_rate > 0):
        raise ValueError(f"request_rate must be a finite number > 0, got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, len(requests))
    times = np.cumsum(gaps) - (gaps[0] if len(gaps) else 0.0)
    return [replace(r, arrival_time=float(t)) for r, t in zip(requests, times, strict=True)]


# Traces.


def load_trace(
    path: str | Path,
    *,
    hash_block_size: int = MOONCAKE_BLOCK_SIZE,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Request]:
    """Reads a JSONL trace, one request per line, in file order.

    Each line is an object with:

    - the prompt: `prompt_token_ids` (a list of ids), or `hash_ids` (one id per block of
      `hash_block_size` tokens, equal ids meaning equal blocks, as in Mooncake's traces) with
      `input_length` (the prompt's tokens; the last block may be partial);
    - the output: `max_tokens` or `output_length`;
    - optionally the arrival: `arrival_time` in seconds, or `timestamp` in milliseconds
      (Mooncake), and `metadata` (an object).

    A hash id becomes `hash_block_size` random token ids seeded by (seed, hash id), so prompts
    share exactly the blocks their hash ids share.
    """
    blocks: dict[int, np.ndarray] = {}

    def block_of(hash_id: int) -> np.ndarray:
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, hash_id])
            blocks[hash_id] = _tokens(rng, hash_block_size, vocab_size)
        return blocks[hash_id]

    requests = []
    with open(path) as file:
        for line_number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "prompt_token_ids" in record:
                    prompt = np.asarray(record["prompt_token_ids"])
                    if prompt.size and not np.issubdtype(prompt.dtype, np.integer):
                        raise ValueError("prompt_token_ids must be integers")
                else:
                    hash_ids = record["hash_ids"]
                    if not (isinstance(hash_ids, list) and all(map(_is_int, hash_ids))):
                        raise ValueError(f"hash_ids must be a list of integers, got {hash_ids!r}")
                    length = record.get("input_length", len(hash_ids) * hash_block_size)
                    if not _is_int(length):
                        raise ValueError(f"input_length must be an integer, got {length!r}")
                    if not 0 < length <= len(hash_ids) * hash_block_size:
                        raise ValueError(
                            f"input_length {length} is not in [1, {len(hash_ids)} hash blocks of "
                            f"{hash_block_size} tokens]"
                        )
                    prompt = np.concatenate([block_of(h) for h in hash_ids])[:length]
                max_tokens = record.get("max_tokens", record.get("output_length"))
                if max_tokens is None:
                    raise KeyError("max_tokens or output_length")
                arrival = record.get("arrival_time")
                if arrival is None and "timestamp" in record:
                    arrival = record["timestamp"] / 1000.0
                arrival = None if arrival is None else float(arrival)
                requests.append(Request(prompt, max_tokens, arrival, record.get("metadata")))
            except (KeyError, ValueError, TypeError) as error:
                raise ValueError(f"{path}:{line_number}: bad trace record ({error})") from None
    return requests


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def save_trace(path: str | Path, requests: Iterable[Request]) -> None:
    """Writes requests as a JSONL trace that `load_trace` reads back (token ids)."""
    with open(path, "w") as file:
        for request in requests:
            record: dict = {
                "prompt_token_ids": request.prompt_token_ids.tolist(),
                "max_tokens": request.max_tokens,
            }
            if request.arrival_time is not None:
                record["arrival_time"] = request.arrival_time
            if request.metadata is not None:
                record["metadata"] = request.metadata
            file.write(json.dumps(record) + "\n")


# The command line (shared by scripts/cache_sim.py and scripts/bench.py).

WORKLOADS = ("shared-prefix", "multi-turn", "prefix-repetition", "hot-prefix-scans", "trace")


def add_workload_arguments(
    parser: argparse.ArgumentParser, *, required: bool = True
) -> list[tuple[str, str]]:
    """Adds `--workload NAME` and the flags of every workload (defaults: the generators');
    returns those flags, (flag, dest) each."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=WORKLOADS, required=required, default=None)
    actions = []
    add = lambda *flags, **options: actions.append(group.add_argument(*flags, **options))
    add("--groups", type=int, default=64, help="shared-prefix")
    add("--prompts-per-group", type=int, default=16, help="shared-prefix")
    add("--question-len", type=int, default=128, help="shared-prefix")
    add("--order", default="grouped", choices=["grouped", "interleaved", "shuffled"])
    add("--prefix-len", type=int, default=None, help="default 2048 (prefix-rep. 1024, scans 16)")
    add("--conversations", type=int, default=64, help="multi-turn")
    add("--turns", type=int, default=8, help="multi-turn")
    add("--system-len", type=int, default=512, help="multi-turn")
    add("--user-len", type=int, default=64, help="multi-turn")
    add("--num-requests", type=int, default=1024, help="prefix-repetition")
    add("--num-prefixes", type=int, default=16, help="prefix-repetition")
    add("--suffix-len", type=int, default=128, help="prefix-repetition")
    add("--zipf", type=float, default=0.0, help="prefix-repetition skew")
    add("--rounds", type=int, default=8, help="hot-prefix-scans")
    add("--trace", default=None, help="trace: a JSONL file")
    add("--trace-block-size", type=int, default=MOONCAKE_BLOCK_SIZE)
    add("--output-len", type=int, default=None, help="default 256 (128; scans 1)")
    add("--request-rate", type=float, default=None, help="Poisson arrivals")
    add("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    add("--seed", type=int, default=0)
    return [(action.option_strings[0], action.dest) for action in actions]


def workload_from_arguments(args: argparse.Namespace) -> list[Request]:
    """The requests that the flags of `add_workload_arguments` describe; lengths not given are
    each workload's defaults."""
    common = {"vocab_size": args.vocab_size, "seed": args.seed}
    generated = common if args.output_len is None else {**common, "output_len": args.output_len}
    prefixed = (
        generated if args.prefix_len is None else {**generated, "prefix_len": args.prefix_len}
    )
    if args.workload == "shared-prefix":
        options = {"question_len": args.question_len, "order": args.order}
        requests = shared_prefix(args.groups, args.prompts_per_group, **options, **prefixed)
    elif args.workload == "multi-turn":
        requests = multi_turn_chat(
            args.conversations, args.turns, args.system_len, args.user_len, **generated
        )
    elif args.workload == "prefix-repetition":
        options = {"suffix_len": args.suffix_len, "zipf_exponent": args.zipf}
        requests = prefix_repetition(args.num_requests, args.num_prefixes, **options, **prefixed)
    elif args.workload == "hot-prefix-scans":
        requests = hot_prefix_with_scans(args.rounds, **prefixed)
    elif args.workload == "trace":
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE")
        requests = load_trace(args.trace, hash_block_size=args.trace_block_size, **common)
    else:
        raise ValueError(f"unknown workload {args.workload!r}; one of {WORKLOADS}")
    if args.request_rate is not None:
        requests = with_poisson_arrivals(requests, args.request_rate, seed=args.seed)
    return requests
