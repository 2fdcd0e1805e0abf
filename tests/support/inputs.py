"""Model inputs for the model tests: `ModelInputs` for chunks of sequences, a small config, and
the relative error outputs are compared by."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxllm.model.config import Qwen3Config
from jaxllm.model.inputs import ModelInputs


@dataclass(frozen=True)
class Chunk:
    """The new tokens of one sequence in one step.

    Attributes:
        token_ids: the tokens computed in this step.
        start: tokens of the sequence already in the cache (the first new token's position).
        block_table: the sequence's block ids, in order, covering `start + len(token_ids)`.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]


def slot(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def build_inputs(
    chunks: list[Chunk],
    block_size: int,
    tile_size: int,
    table_width: int,
    num_tiles: int | None = None,
    sample_all: bool = True,
) -> ModelInputs:
    """Lays chunks out in tiles (front padding per chunk), padded to `num_tiles` tiles.

    Sampled rows are, chunk by chunk, every new token (`sample_all`) or each chunk's last one.
    """
    token_ids, positions, slots, block_tables, context_lens, samples = [], [], [], [], [], []
    for chunk in chunks:
        count = len(chunk.token_ids)
        padding = -count % tile_size
        row0 = len(token_ids) + padding
        token_ids += [0] * padding + list(chunk.token_ids)
        positions += [0] * padding + list(range(chunk.start, chunk.start + count))
        slots += [-1] * padding + [
            slot(chunk.block_table, p, block_size) for p in range(chunk.start, chunk.start + count)
        ]
        table = list(chunk.block_table) + [0] * (table_width - len(chunk.block_table))
        for tile in range((padding + count) // tile_size):
            block_tables.append(table)
            context_lens.append(chunk.start + (tile + 1) * tile_size - padding)
        samples += list(range(row0, row0 + count)) if sample_all else [row0 + count - 1]
    num_tiles = num_tiles or len(block_tables)
    assert num_tiles >= len(block_tables)
    extra_tiles = num_tiles - len(block_tables)
    token_ids += [0] * extra_tiles * tile_size
    positions += [0] * extra_tiles * tile_size
    slots += [-1] * extra_tiles * tile_size
    block_tables += [[0] * table_width] * extra_tiles
    context_lens += [0] * extra_tiles
    as_array = lambda values: jnp.asarray(np.array(values, np.int32))
    return ModelInputs(
        token_ids=as_array(token_ids),
        positions=as_array(positions),
        slot_mapping=as_array(slots),
        block_tables=as_array(block_tables),
        context_lens=as_array(context_lens),
        sample_indices=as_array(samples),
    )


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| over all elements, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def small_config(**overrides) -> Qwen3Config:
    """A float32 model small enough to run many steps in a test: 3 layers, 2 heads of 16, one kv
    head, a vocabulary of 64."""
    values = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        dtype="float32",
    )
    return Qwen3Config(**values | overrides)
