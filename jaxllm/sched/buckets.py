"""The bucket ladder: the finite set of padded step shapes, so every shape the device will see
is known (and compiled) before the first step.

Legend: T tokens, G tiles, S sampled rows, W block-table width (blocks), K decode steps.
Decode steps have G == T == S (tiles of one token); prefill steps have G = T // prefill_tile
and S = G.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal, NamedTuple

from jaxllm.model.inputs import ModelInputs, SamplingInputs
from jaxllm.sched.config import SchedulerConfig

StepKind = Literal["prefill", "decode"]

# NOTE: decode plans of several steps pay off where the host's time per step exceeds the
# device's, in small batches; each batch size of them is one more executable per sampler mode.
MULTI_STEP_MAX_SEQS = 32
# NOTE: multi-step decode buckets hold at least this many rows: on an H200 a 0.6B model's matmuls
# of 8 rows (GEMMs) run faster than those of 1 - 4 (XLA's GEMV fusions; docs/performance.md).
MULTI_STEP_MIN_ROWS = 8


class Bucket(NamedTuple):
    """The padded shape of one step: what one compiled executable takes."""

    kind: StepKind
    num_tokens: int  # T
    num_tiles: int  # G
    num_sampled: int  # S
    width: int  # W
    num_steps: int = 1  # K

    def padding(self) -> tuple[ModelInputs, SamplingInputs]:
        """Inputs of a step of padding alone, in this bucket's shape."""
        _, tokens, tiles, sampled, width, _ = self
        return ModelInputs.padding(tokens, tiles, sampled, width), SamplingInputs.padding(sampled)


def _ladder(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest * 2**k up to largest, and largest itself."""
    rungs, rung = [], smallest
    while rung < largest:
        rungs.append(rung)
        rung *= 2
    return (*rungs, largest)


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
        widths: block-table widths W: powers of two up to the blocks of max_model_len.
        num_steps: K of the multi-step decode buckets (`multi_step_sizes`; none when 1).
    """

    decode_sizes: tuple[int, ...]
    prefill_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    prefill_tile: int
    num_steps: int = 1

    @classmethod
    def from_config(cls, config: SchedulerConfig, *, one_width: bool = False) -> BucketLadder:
        """The ladder of `config`'s limits; `one_width` pads every block table to the widest.

        One width suits kernels whose cost follows the context lengths, not the table width
        (FlashAttention's paged kernel), and divides the shapes to compile by the widths.
        """
        widest = config.max_blocks_per_seq
        return cls(
            decode_sizes=_ladder(1, config.max_num_seqs),
            prefill_sizes=_ladder(config.prefill_tile, config.max_num_batched_tokens),
            widths=(widest,) if one_width else _ladder(1, widest),
            prefill_tile=config.prefill_tile,
            num_steps=config.num_scheduler_steps,
        )

    @property
    def multi_step_max_seqs(self) -> int:
        """The largest decode batch that runs `num_steps` steps per plan (0: none)."""
        return 0 if self.num_steps == 1 else min(MULTI_STEP_MAX_SEQS, self.decode_sizes[-1])

    @property
    def multi_step_sizes(self) -> tuple[int, ...]:
        """The batch sizes of the multi-step decode buckets: the decode sizes up to
        `multi_step_max_seqs`, at least `MULTI_STEP_MIN_ROWS` (or all of them)."""
        largest = self.multi_step_max_seqs
        smallest = min(MULTI_STEP_MIN_ROWS, largest)
        return tuple(n for n in self.decode_sizes if smallest <= n <= largest)

    def decode_bucket(self, num_seqs: int, num_blocks: int, num_steps: int = 1) -> Bucket:
        """The smallest decode bucket of `num_steps` steps holding `num_seqs` rows with tables
        of `num_blocks`."""
        if num_steps != 1 and (num_steps != self.num_steps or num_seqs > self.multi_step_max_seqs):
            raise ValueError(f"no decode bucket of {num_steps} steps for {num_seqs} sequences")
        sizes = self.decode_sizes if num_steps == 1 else self.multi_step_sizes
        size = _round_up(sizes, num_seqs, "decode batch size")
        width = _round_up(self.widths, num_blocks, "block-table width")
        return Bucket("decode", size, size, size, width, num_steps)

    @property
    def max_sampled_rows(self) -> int:
        """The most sampled rows of any bucket, at least one prefill tile's (an all-rows chunk
        of one tile): every step returns this many."""
        largest = max(self.decode_sizes[-1], self.prefill_sizes[-1] // self.prefill_tile)
        return max(largest, self.prefill_tile)

    @property
    def all_rows_tokens(self) -> int:
        """The longest prefill chunk whose every row can be sampled (for prompt logprobs): the
        largest prefill size within `max_sampled_rows`."""
        return max(n for n in self.prefill_sizes if n <= self.max_sampled_rows)

    def prefill_bucket(
        self, num_padded_tokens: int, num_blocks: int, all_rows: bool = False
    ) -> Bucket:
        """The smallest prefill bucket holding `num_padded_tokens` (whole tiles); `all_rows`:
        one that samples every row (S = T), compiled when first needed."""
        size = _round_up(self.prefill_sizes, num_padded_tokens, "prefill token count")
        width = _round_up(self.widths, num_blocks, "block-table width")
        num_tiles = size // self.prefill_tile
        return Bucket("prefill", size, num_tiles, size if all_rows else num_tiles, width)

    def buckets(self) -> list[Bucket]:
        """Every shape a step can have: what the engine compiles at start-up."""
        decode = [self.decode_bucket(size, w) for size in self.decode_sizes for w in self.widths]
        decode += [
            self.decode_bucket(size, w, self.num_steps)
            for size in self.multi_step_sizes
            for w in self.widths
        ]
        prefill = [self.prefill_bucket(size, w) for size in self.prefill_sizes for w in self.widths]
        return decode + prefill
