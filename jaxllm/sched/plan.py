"""A step's plan: what the scheduler decided, and the padded arrays the device reads.

`plan_step` is the only place the step's arrays (in the format of `jaxllm.model.inputs`) are
built, padded to a bucket of the fixed `BucketLadder` (shapes as in `jaxllm.sched.buckets`). A
decode plan of K > 1 steps runs them in one executable, each step's sampled tokens the next
one's inputs; the host gives the KV slots of every step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from jaxllm.model.inputs import ModelInputs, SamplingInputs, fill_chunks
from jaxllm.sched.buckets import Bucket, BucketLadder, StepKind
from jaxllm.sched.processors import ProcessorPlan, processor_plan
from jaxllm.sched.sequence import Sequence


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One step: its sequences, their new tokens, and the padded inputs of the device.

    Attributes:
        seqs: the scheduled sequences, in row order.
        start_positions: each sequence's first new token (its num_computed_tokens before).
        num_new_tokens: tokens each sequence computes in this step (its chunk; in a decode
            plan of K steps, those of the K it samples a token of its own in).
        samples: whether each row's sampled token is its sequence's next token; False for a
            prefill chunk that stops short of the sequence's end.
        inputs: the model's inputs (numpy, the bucket's shape). The token of a decode row
            whose value the previous step is still sampling is 0 here: the runner takes it
            from that step's output on the device. None in an outline.
        sampling: the sampler's inputs, one row per sequence (padding rows are greedy); None
            in an outline.
        step_slots: [K, T] the KV slot of each row at each step of a decode plan of K > 1
            steps (row 0 is `inputs.slot_mapping`); -1 past a sequence's steps. None otherwise.
        logprobs: a row that samples asks for the logprobs of its token, or the plan samples
            every row of a prompt-logprobs chunk (`all_rows`).
        logprob_targets: with `logprobs`, [S] the token whose logprob each sampled row reports:
            -1 for the token it samples, else (a prompt-logprobs chunk) the prompt token after
            its position; None otherwise.
        processors: the step's penalties, biases and bad words (`sched.processors`); None
            when no row asks for any.
    """

    seqs: list[Sequence]
    start_positions: list[int]
    num_new_tokens: list[int]
    samples: list[bool]
    bucket: Bucket
    inputs: ModelInputs | None
    sampling: SamplingInputs | None
    step_slots: np.ndarray | None = None
    logprobs: bool = False
    logprob_targets: np.ndarray | None = None
    processors: ProcessorPlan | None = None

    @property
    def all_rows(self) -> bool:
        """A one-sequence prefill chunk sampling every row (prompt logprobs), the last first."""
        return self.is_prefill and self.bucket.num_sampled == self.bucket.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.bucket.kind == "prefill"

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens computed in this step."""
        return sum(self.num_new_tokens)

    def row_tokens(self, sampled_token_ids) -> tuple[list[list[int]], list[int]]:
        """Each row's tokens of the step's sampled ones ([S] or [K, S], as
        `Scheduler.update` takes them), and how many of them are the row's own."""
        tokens = np.atleast_2d(np.asarray(sampled_token_ids))[:, : self.num_seqs].T.tolist()
        return tokens, self.num_new_tokens if self.bucket.num_steps > 1 else [1] * self.num_seqs


def plan_step(
    ladder: BucketLadder,
    block_size: int,
    kind: StepKind,
    seqs: list[Sequence],
    starts: list[int],
    counts: list[int],
    num_steps: int = 1,
    all_rows: bool = False,
    new_slots: frozenset[int] | None = None,
    outline: bool = False,
) -> StepPlan:
    """The plan of a step computing tokens `starts[i]` .. `starts[i] + counts[i] - 1` of
    `seqs[i]`, its arrays padded to the smallest bucket. A decode plan computes one token per
    sequence in each of its `num_steps` steps, `counts[i]` <= `num_steps` of them its own.
    `new_slots`: the ids of sequences whose logits processors' slot is written in this step;
    None when no sequence holds a slot (no row to look at). An `outline` has no arrays: the
    sequences, their counts, which rows sample and the bucket, for a simulator."""
    starts_array = np.array(starts, dtype=np.int64)  # [n]
    counts_array = np.array(counts, dtype=np.int64)  # [n]
    ends = starts_array + counts_array
    needed = (-(-ends // block_size)).tolist()  # blocks up to each chunk's end
    block_tables = [seq.block_table[:k] for seq, k in zip(seqs, needed, strict=True)]
    tables = None if outline else _block_table_rows(block_tables)
    width = max(map(len, block_tables)) if outline else tables.shape[1]
    if kind == "decode":  # every decode row samples (also when its token is still on the device)
        bucket, samples = ladder.decode_bucket(len(seqs), width, num_steps), [True] * len(seqs)
    else:  # a prefill chunk samples when it reaches its sequence's end
        tile = ladder.prefill_tile
        bucket = ladder.prefill_bucket(sum(-(-c // tile) for c in counts) * tile, width, all_rows)
        samples = [end == seq.num_tokens for seq, end in zip(seqs, ends.tolist(), strict=True)]
    if outline:
        return StepPlan(seqs, starts, counts, samples, bucket, None, None)
    inputs, _ = bucket.padding()
    if kind == "decode":
        token_ids = [seq.token_at(start) for seq, start in zip(seqs, starts, strict=True)]
        rows = _fill_decode(inputs, tables, starts_array, block_size)  # [n]
        ends = starts_array + 1  # a step's layout: one token each
    else:
        token_ids = np.concatenate(
            [seq.token_ids[start:end] for seq, start, end in zip(seqs, starts, ends, strict=True)]
        )
        rows = fill_chunks(inputs, tables, starts_array, counts_array, block_size)  # [N]
    inputs.token_ids[rows] = token_ids
    steps = [end - seq.num_prompt_tokens for seq, end in zip(seqs, ends.tolist(), strict=True)]
    sampling = SamplingInputs.from_params([seq.params for seq in seqs], steps, bucket.num_sampled)
    step_slots = None
    if num_steps > 1:
        step_slots = _step_slots(tables, starts_array, counts_array, block_size, bucket)
    logprobs = all_rows or any(
        s and seq.params.logprobs is not None for seq, s in zip(seqs, samples, strict=True)
    )
    targets = np.full(bucket.num_sampled, -1, np.int32) if logprobs else None
    if all_rows:  # one sequence: its last row first, then the others, each with its next token
        (seq,) = seqs
        order = np.concatenate([rows[-1:], rows[:-1]])
        inputs.sample_indices[: len(order)] = order
        following = inputs.positions[order] + 1
        in_prompt = following < seq.num_prompt_tokens
        targets[: len(order)][in_prompt] = seq.token_ids[following[in_prompt]]
    processors = None
    if new_slots is not None:
        processors = processor_plan(seqs, samples, steps, bucket.num_sampled, new_slots)
    return StepPlan(
        seqs, starts, counts, samples, bucket, inputs, sampling, step_slots, logprobs, targets,
        processors,
    )  # fmt: skip


def _step_slots(
    tables: np.ndarray, starts: np.ndarray, counts: np.ndarray, block_size: int, bucket: Bucket
) -> np.ndarray:
    """[K, T] the slot of decode row i at step j: position starts[i] + j, for j < counts[i];
    -1 (no write) after, and for padding rows."""
    step = np.arange(bucket.num_steps)[:, None]  # [K, 1]
    positions = starts[None, :] + step  # [K, n]
    block_index = np.minimum(positions // block_size, tables.shape[1] - 1)
    blocks = np.take_along_axis(tables, block_index.T, axis=1).T  # [K, n]
    slots = np.full((bucket.num_steps, bucket.num_tokens), -1, np.int32)
    slots[:, : len(starts)] = np.where(
        step < counts[None, :], blocks * block_size + positions % block_size, -1
    )
    return slots


def _fill_decode(
    inputs: ModelInputs, tables: np.ndarray, starts: np.ndarray, block_size: int
) -> np.ndarray:
    """`fill_chunks` for tiles of one token, one per sequence (a decode step): row i is
    sequence i's token, at position starts[i]; returns the rows, [n]."""
    rows = np.arange(len(starts))
    block_ids = tables[rows, starts // block_size]
    inputs.positions[rows] = starts
    inputs.slot_mapping[rows] = block_ids * block_size + starts % block_size
    inputs.block_tables[rows, : tables.shape[1]] = tables
    inputs.context_lens[rows] = starts + 1
    inputs.sample_indices[rows] = rows
    return rows


def _block_table_rows(block_tables: list[list[int]]) -> np.ndarray:
    """[n, max length] the block tables as rows of one int32 array, zero-padded."""
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=total)
    tables = np.zeros((len(block_tables), int(lengths.max())), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = flat  # filled in row order
    return tables


def keep_prompt_logprobs(plan: StepPlan, logprobs: np.ndarray) -> None:
    """Appends the logprobs of the prompt tokens an all-rows chunk computed to its sequence
    (a preempted sequence computing them again keeps the first ones)."""
    (seq,) = plan.seqs
    rows = plan.inputs.sample_indices[: plan.num_tokens]
    following = plan.inputs.positions[rows] + 1
    for index in np.argsort(following):
        if following[index] == len(seq.prompt_logprobs) + 1 < seq.num_prompt_tokens:
            seq.prompt_logprobs.append(logprobs[index])
