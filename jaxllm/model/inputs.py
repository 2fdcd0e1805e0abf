"""What one device step reads: the model's inputs and the sampler's, one format for host and device.

The host (`jaxllm.sched.plan`) fills these with numpy arrays, starting from `padding(...)`; in
the jitted step the same tuples hold traced arrays. This module imports no jax.

A step's tokens are laid out in *tiles* of `tile_size = T // G` consecutive tokens of one
sequence at consecutive positions. A sequence's chunk is padded at the *front* to whole tiles,
so every tile's last row is a real token; decode steps use tiles of one token (G == T). Every
attention kernel takes this layout (see `attention.py`).

Legend: T tokens in the step, G tiles, W block-table width (blocks), S sampled rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxllm.sampling_params import SamplingParams

# top_k travels as int32; any larger value means the same as the whole vocabulary.
INT32_MAX = np.iinfo(np.int32).max
# The logits processors' slots (`jaxllm.model.logits_processors`): a token's entry in the token
# rows is its count in the output plus this bit where it is in the prompt; the columns of the
# penalty rows.
IN_PROMPT = 1 << 30
PRESENCE, FREQUENCY, REPETITION = range(3)


class ModelInputs(NamedTuple):
    """One step's model inputs (int32 arrays; a pytree, as every NamedTuple).

    Attributes:
        token_ids: [T] token ids; padding rows hold 0.
        positions: [T] position of each token in its sequence; padding rows hold 0.
        slot_mapping: [T] flat KV slot (block_id * block_size + offset) where each token's K/V is
            written; -1 for padding rows, which write nowhere.
        block_tables: [G, W] the block ids of each tile's sequence, in order; unused entries 0.
        context_lens: [G] number of KV positions each tile attends to: the position of the
            tile's last token + 1; 0 for tiles that are all padding.
        sample_indices: [S] rows of `token_ids` whose logits are returned; padding entries 0.
    """

    token_ids: Any
    positions: Any
    slot_mapping: Any
    block_tables: Any
    context_lens: Any
    sample_indices: Any

    @property
    def tile_size(self) -> int:
        return self.token_ids.shape[0] // self.block_tables.shape[0]

    @classmethod
    def padding(cls, num_tokens: int, num_tiles: int, num_sampled: int, width: int) -> ModelInputs:
        """A step of padding alone (numpy): it writes nothing and attends to nothing."""
        zeros = lambda *shape: np.zeros(shape, np.int32)
        return cls(
            token_ids=zeros(num_tokens),
            positions=zeros(num_tokens),
            slot_mapping=np.full(num_tokens, -1, np.int32),
            block_tables=zeros(num_tiles, width),
            context_lens=zeros(num_tiles),
            sample_indices=zeros(num_sampled),
        )


def fill_chunks(
    inputs: ModelInputs, tables: np.ndarray, starts: np.ndarray, counts: np.ndarray, block_size: int
) -> np.ndarray:
    """Lays chunks of sequences out in `inputs` (padding already): chunk i, tokens starts[i] ..
    starts[i] + counts[i] - 1 of the sequence whose blocks are tables[i], padded at the front to
    whole tiles; its last row sampled. Writes all but the token ids, whose rows it returns: [N],
    chunk i's first_rows[i] + padding[i] ... + counts[i] - 1."""
    num, tile = len(counts), inputs.tile_size
    num_tiles = -(-counts // tile)  # [n]
    padding = num_tiles * tile - counts  # [n] front padding of each chunk
    first_rows = np.cumsum(num_tiles * tile) - num_tiles * tile  # [n]

    chunk_firsts = np.cumsum(counts) - counts  # [n] offsets in the concatenated chunks
    base = np.arange(int(counts.sum()), dtype=np.int64)  # [N]
    token_positions = base + np.repeat(starts - chunk_firsts, counts)  # [N]
    rows = base + np.repeat(first_rows + padding - chunk_firsts, counts)  # [N]
    block_indices, offsets = np.divmod(token_positions, block_size)  # [N], [N]
    block_indices += np.repeat(np.arange(num) * tables.shape[1], counts)
    inputs.positions[rows] = token_positions
    inputs.slot_mapping[rows] = np.take(tables.ravel(), block_indices) * block_size + offsets

    # Tiles: tile j of chunk i ends at position starts[i] - padding[i] + (j + 1) * tile - 1.
    num_real_tiles = int(num_tiles.sum())
    seq_of_tile = np.repeat(np.arange(num), num_tiles)  # [g]
    tile_index = np.arange(num_real_tiles) - np.repeat(np.cumsum(num_tiles) - num_tiles, num_tiles)
    inputs.block_tables[:num_real_tiles, : tables.shape[1]] = tables[seq_of_tile]
    inputs.context_lens[:num_real_tiles] = (
        np.repeat(starts - padding, num_tiles) + (tile_index + 1) * tile
    )
    inputs.sample_indices[:num] = first_rows + num_tiles * tile - 1
    return rows


class SamplingInputs(NamedTuple):
    """Per-row sampling settings of one step (a pytree of [S] arrays).

    Attributes:
        temperature: [S] float32; below `sampler.GREEDY_TEMPERATURE` means greedy (argmax).
        top_k: [S] int32; keep the k largest logits; 0 keeps all.
        top_p: [S] float32; keep the smallest prefix of tokens, by falling probability, whose
            mass reaches top_p (the boundary token included); 1 keeps all.
        min_p: [S] float32; drop tokens whose probability is below min_p times the top one;
            0 keeps all.
        seeds: [S] uint32; the row's seed folded to 32 bits (`fold_seed`: the seed itself
            below 2**32).
        seed_high: [S] uint32; the seed's high 32 bits: with `seeds`, all 64 bits of the seed
            select the row's random stream.
        steps: [S] int32; tokens the request generated so far (selects the draw in the stream).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seeds: Any
    seed_high: Any
    steps: Any

    @classmethod
    def padding(cls, num_rows: int) -> SamplingInputs:
        """Rows that sample greedily (numpy), so padding never asks for a costlier sampler."""
        return cls(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.zeros(num_rows, np.int32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            seeds=np.zeros(num_rows, np.uint32),
            seed_high=np.zeros(num_rows, np.uint32),
            steps=np.zeros(num_rows, np.int32),
        )

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], steps: Sequence[int], num_rows: int | None = None
    ) -> SamplingInputs:
        """The rows' settings (numpy) from each row's SamplingParams and number of generated
        tokens, padded with greedy rows to `num_rows` (default len(params))."""
        num_rows = len(params) if num_rows is None else num_rows
        if len(steps) != len(params) or num_rows < len(params):
            raise ValueError(f"{len(params)} params, {len(steps)} steps, {num_rows} rows")
        inputs, n = cls.padding(num_rows), len(params)
        inputs.temperature[:n] = [p.temperature for p in params]
        inputs.top_k[:n] = [min(p.top_k, INT32_MAX) for p in params]
        inputs.top_p[:n] = [p.top_p for p in params]
        inputs.min_p[:n] = [p.min_p for p in params]
        seeds = [p.sampling_seed for p in params]
        inputs.seeds[:n] = [fold_seed(seed) for seed in seeds]
        inputs.seed_high[:n] = [seed >> 32 for seed in seeds]
        inputs.steps[:n] = steps
        return inputs


def fold_seed(seed: int) -> int:
    """A seed in [0, 2**64) folded to 32 bits: the xor of its halves (a seed below 2**32 is its
    own fold; `SamplingInputs.seed_high` keeps the high half)."""
    return (seed ^ (seed >> 32)) & 0xFFFF_FFFF
