"""Batch descriptors: one scheduled step as padded numpy arrays, in the layout of
`jaxllm.model.inputs.ModelInputs`, plus the sampler's per-row settings.

Shapes come from a fixed `BucketLadder`, so every shape the device will see is known before the
first step. Legend: T tokens, G tiles, S sampled rows, W block-table width (blocks). Decode steps
have G == T == S (tiles of one token); prefill steps have G = T // prefill_tile and S = G.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from jaxllm.sched.config import SchedulerConfig
from jaxllm.sched.scheduler import ScheduledBatch
from jaxllm.sched.sequence import Sequence

# top_k travels as int32; any larger value means the same as the whole vocabulary.
INT32_MAX = np.iinfo(np.int32).max

StepKind = Literal["prefill", "decode"]


class BucketShape(NamedTuple):
    """The padded shape of one step: what one compiled executable takes."""

    kind: StepKind
    num_tokens: int  # T
    num_tiles: int  # G
    num_sampled: int  # S
    width: int  # W


def _ladder(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest * 2**k up to largest, and largest itself."""
    rungs = []
    rung = smallest
    while rung < largest:
        rungs.append(rung)
        rung *= 2
    rungs.append(largest)
    return tuple(rungs)


def _round_up(rungs: tuple[int, ...], value: int, what: str) -> int:
    index = bisect.bisect_left(rungs, value)
    if index == len(rungs):
        raise ValueError(f"{what} {value} is beyond the ladder's largest bucket {rungs[-1]}")
    return rungs[index]


@dataclass(frozen=True)
class BucketLadder:
    """The finite set of padded step shapes.

    Attributes:
        decode_sizes: decode batch sizes B (T = G = S = B): powers of two up to max_num_seqs.
        prefill_sizes: prefill token counts T: prefill_tile * 2**k up to max_num_batched_tokens.
        widths: block-table widths W: powers of two up to ceil(max_model_len / block_size).
        prefill_tile: tokens per prefill tile.
    """

    decode_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    prefill_tile: int

    @classmethod
    def from_config(cls, config: SchedulerConfig, *, one_width: bool = False) -> BucketLadder:
        """The ladder of `config`; `one_width` pads every block table to the widest.

        One width suits attention kernels whose cost follows the context lengths, not the
        table width (FlashAttention's paged kernel): it divides the shapes to compile by the
        number of widths.
        """
        widest = config.max_blocks_per_seq
        return cls(
            decode_sizes=_ladder(1, config.max_num_seqs),
            prefill_sizes=_ladder(config.prefill_tile, config.max_num_batched_tokens),
            widths=(widest,) if one_width else _ladder(1, widest),
            prefill_tile=config.prefill_tile,
        )

    def decode_shape(self, num_seqs: int, num_blocks: int) -> BucketShape:
        """The smallest decode bucket holding `num_seqs` rows with tables of `num_blocks`."""
        size = _round_up(self.decode_sizes, num_seqs, "decode batch size")
        width = _round_up(self.widths, num_blocks, "block-table width")
        return BucketShape("decode", size, size, size, width)

    def prefill_shape(self, num_padded_tokens: int, num_blocks: int) -> BucketShape:
        """The smallest prefill bucket holding `num_padded_tokens` (whole tiles)."""
        size = _round_up(self.prefill_sizes, num_padded_tokens, "prefill token count")
        width = _round_up(self.widths, num_blocks, "block-table width")
        num_tiles = size // self.prefill_tile
        return BucketShape("prefill", size, num_tiles, num_tiles, width)

    def all_shapes(self) -> list[BucketShape]:
        """Every shape a step can have: what the engine compiles at start-up."""
        decode = [
            self.decode_shape(size, width) for size in self.decode_sizes for width in self.widths
        ]
        prefill = [
            self.prefill_shape(size, width) for size in self.prefill_sizes for width in self.widths
        ]
        return decode + prefill


@dataclass(frozen=True, eq=False)
class BatchDescriptor:
    """One step's device inputs (numpy, padded to `shape`) and the host's record of its rows.

    Model inputs, exactly as `jaxllm.model.inputs.ModelInputs` (int32):
        token_ids [T], positions [T], slot_mapping [T] (-1 on padding rows),
        block_tables [G, W], context_lens [G], sample_indices [S].
    Sampler inputs, one per sampled row (padding rows: temperature 0, top_k 0, top_p 1, min_p 0,
    seed 0, step 0):
        temperature [S] f32, top_k [S] i32, top_p [S] f32, min_p [S] f32,
        seeds [S] uint32 (`params.sampling_seed` folded to 32 bits: low ^ high word),
        sample_steps [S] i32 (output tokens the sequence already has).
    Per-sequence extras for other attention backends (int32, padded with 0):
        query_starts [S] (row of the sequence's first real token), query_lens [S] (its real
        tokens), seq_lens [S] (its context after the step).
    Host side:
        batch: the scheduled step (sequences, chunks, which sampled tokens to append).
        shape: the bucket.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    sample_indices: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seeds: np.ndarray
    sample_steps: np.ndarray
    query_starts: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    batch: ScheduledBatch
    shape: BucketShape

    @property
    def seqs(self) -> list[Sequence]:
        """The sequences of the real sampled rows 0 .. num_seqs - 1, in order."""
        return self.batch.seqs

    @property
    def appends(self) -> list[bool]:
        """Whether each real row's sampled token is appended to its sequence."""
        return self.batch.appends

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens of the step."""
        return self.batch.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.batch.is_prefill

    def model_inputs(self) -> dict[str, np.ndarray]:
        """The six `ModelInputs` arrays by field name."""
        return {name: getattr(self, name) for name in _MODEL_INPUT_FIELDS}


_MODEL_INPUT_FIELDS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "context_lens",
    "sample_indices",
)


class BatchBuilder:
    """Turns `ScheduledBatch`es into `BatchDescriptor`s (fresh arrays every step, no state)."""

    def __init__(self, config: SchedulerConfig, *, one_width: bool = False) -> None:
        self.block_size = config.block_size
        self.ladder = BucketLadder.from_config(config, one_width=one_width)

    def build(self, batch: ScheduledBatch) -> BatchDescriptor:
        if batch.is_prefill:
            return self._build_prefill(batch)
        return self._build_decode(batch)

    def _build_decode(self, batch: ScheduledBatch) -> BatchDescriptor:
        seqs = batch.seqs
        num = len(seqs)
        size = self.block_size
        last_positions = np.array(batch.start_positions, dtype=np.int32)  # [n]
        tables = _block_table_rows([seq.block_table for seq in seqs])
        shape = self.ladder.decode_shape(num, tables.shape[1])
        rows = np.arange(num)
        token_ids = _padded([seq.last_token_id for seq in seqs], shape.num_tokens)
        positions = _padded(last_positions, shape.num_tokens)
        slots = tables[rows, last_positions // size] * size + last_positions % size
        slot_mapping = _padded(slots, shape.num_tokens, fill=-1)
        block_tables = np.zeros((shape.num_tiles, shape.width), dtype=np.int32)
        block_tables[:num, : tables.shape[1]] = tables
        context_lens = _padded(last_positions + 1, shape.num_tiles)
        sample_indices = _padded(rows, shape.num_sampled)
        return self._descriptor(
            batch, shape, token_ids, positions, slot_mapping, block_tables, context_lens,
            sample_indices, query_starts=rows, query_lens=np.ones(num, np.int32),
        )  # fmt: skip

    def _build_prefill(self, batch: ScheduledBatch) -> BatchDescriptor:
        seqs = batch.seqs
        num = len(seqs)
        size = self.block_size
        tile = self.ladder.prefill_tile
        starts = np.array(batch.start_positions, dtype=np.int64)  # [n]
        counts = np.array(batch.num_new_tokens, dtype=np.int64)  # [n]
        ends = starts + counts
        num_tiles = -(-counts // tile)  # [n]
        padding = num_tiles * tile - counts  # [n] front padding of each chunk
        first_rows = np.cumsum(num_tiles * tile) - num_tiles * tile  # [n]
        needed = (-(-ends // size)).tolist()  # blocks up to each chunk's end
        tables = _block_table_rows(
            [seq.block_table[:k] for seq, k in zip(seqs, needed, strict=True)]
        )
        shape = self.ladder.prefill_shape(int(num_tiles.sum()) * tile, tables.shape[1])

        # Real tokens: chunk i fills rows first_rows[i] + padding[i] ... + counts[i] - 1.
        total = int(counts.sum())
        chunk_firsts = np.cumsum(counts) - counts  # [n] offsets in the concatenated chunks
        base = np.arange(total, dtype=np.int32)  # [N]
        token_positions = base + np.repeat((starts - chunk_firsts).astype(np.int32), counts)
        rows = base + np.repeat((first_rows + padding - chunk_firsts).astype(np.int32), counts)
        block_indices, offsets = np.divmod(token_positions, size)  # [N], [N]
        block_indices += np.repeat(np.arange(0, num * tables.shape[1], tables.shape[1]), counts)
        chunks = [
            seq.token_ids[start:end]
            for seq, start, end in zip(seqs, batch.start_positions, ends.tolist(), strict=True)
        ]
        token_ids = np.zeros(shape.num_tokens, dtype=np.int32)
        token_ids[rows] = np.concatenate(chunks)
        positions = np.zeros(shape.num_tokens, dtype=np.int32)
        positions[rows] = token_positions
        slot_mapping = np.full(shape.num_tokens, -1, dtype=np.int32)
        slot_mapping[rows] = np.take(tables.ravel(), block_indices) * size + offsets

        # Tiles: tile j of chunk i ends at position starts[i] - padding[i] + (j + 1) * tile - 1.
        num_real_tiles = int(num_tiles.sum())
        seq_of_tile = np.repeat(np.arange(num), num_tiles)  # [g]
        tile_index = np.arange(num_real_tiles) - np.repeat(
            np.cumsum(num_tiles) - num_tiles, num_tiles
        )
        block_tables = np.zeros((shape.num_tiles, shape.width), dtype=np.int32)
        block_tables[:num_real_tiles, : tables.shape[1]] = tables[seq_of_tile]
        context_lens = np.zeros(shape.num_tiles, dtype=np.int32)
        context_lens[:num_real_tiles] = (
            np.repeat(starts - padding, num_tiles) + (tile_index + 1) * tile
        )
        sample_indices = _padded(first_rows + num_tiles * tile - 1, shape.num_sampled)
        return self._descriptor(
            batch, shape, token_ids, positions, slot_mapping, block_tables, context_lens,
            sample_indices, query_starts=first_rows + padding, query_lens=counts,
        )  # fmt: skip

    def _descriptor(
        self,
        batch: ScheduledBatch,
        shape: BucketShape,
        *model_inputs: np.ndarray,
        query_starts: np.ndarray,
        query_lens: np.ndarray,
    ) -> BatchDescriptor:
        seqs = batch.seqs
        num_rows = shape.num_sampled
        params = [seq.params for seq in seqs]
        seeds = [p.sampling_seed for p in params]
        seq_lens = [
            start + count
            for start, count in zip(batch.start_positions, batch.num_new_tokens, strict=True)
        ]
        return BatchDescriptor(
            *model_inputs,
            # NOTE: padding rows are greedy, so they never make the host pick a costlier
            # sampler variant than the real rows need (sampler.sampler_mode).
            temperature=_padded([p.temperature for p in params], num_rows, 0.0, np.float32),
            top_k=_padded([min(p.top_k, INT32_MAX) for p in params], num_rows),
            top_p=_padded([p.top_p for p in params], num_rows, 1.0, np.float32),
            min_p=_padded([p.min_p for p in params], num_rows, 0.0, np.float32),
            seeds=_padded([(s ^ (s >> 32)) & 0xFFFFFFFF for s in seeds], num_rows, 0, np.uint32),
            sample_steps=_padded(
                [seq.num_tokens - seq.num_prompt_tokens for seq in seqs], num_rows
            ),
            query_starts=_padded(query_starts, num_rows),
            query_lens=_padded(query_lens, num_rows),
            seq_lens=_padded(seq_lens, num_rows),
            batch=batch,
            shape=shape,
        )


def _padded(values, length: int, fill: float = 0, dtype: type = np.int32) -> np.ndarray:
    """A [length] array: `values` first, `fill` after."""
    out = np.full(length, fill, dtype=dtype)
    out[: len(values)] = values
    return out


def _block_table_rows(block_tables: list[list[int]]) -> np.ndarray:
    """[n, max length] the block tables as rows of one int32 array, zero-padded."""
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=total)
    rows = np.repeat(np.arange(len(block_tables)), lengths)
    cols = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    tables = np.zeros((len(block_tables), int(lengths.max())), dtype=np.int32)
    tables[rows, cols] = flat
    return tables
