"""Factories and a fake device for the scheduler tests (pure Python + numpy).

`FakeDevice` stands in for the model. It keeps one value per KV slot: the identity of the token
at that position *and of everything before it*, computed the way attention would, by reading
the previous position's slot through the tile's block table. The token it samples is a function
of that identity. So a wrong block table, slot mapping, position, tile layout or prefix-cache hit
changes the identities and shows up as a wrong token, as a real model's garbage would.
"""

from __future__ import annotations

import numpy as np

from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import BatchBuilder, BatchDescriptor, Scheduler, SchedulerConfig, Sequence

ROOT_IDENTITY = 17
VOCAB = 50


def make_config(**overrides) -> SchedulerConfig:
    settings = dict(
        num_blocks=16,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=64,
        prefill_tile=4,
    )
    settings.update(overrides)
    return SchedulerConfig(**settings)


def make_scheduler(eviction_policy: str = "lru", **overrides) -> Scheduler:
    return Scheduler(make_config(**overrides), eviction_policy=eviction_policy)


def make_seq(
    scheduler: Scheduler, prompt: int | list[int], max_tokens: int = 4, **params
) -> Sequence:
    """Adds a request; an int prompt means `list(range(100, 100 + prompt))`."""
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("ignore_eos", True)
    return scheduler.add(tokens, SamplingParams(max_tokens=max_tokens, **params))


def identity(parent: int, token: int) -> int:
    return hash((parent, int(token)))


def next_token(prefix_identity: int) -> int:
    """What the fake model samples after a prefix: a deterministic function of its identity."""
    return prefix_identity % VOCAB


def expected_identities(token_ids) -> list[int]:
    """The identity of each position of a sequence, computed from its tokens alone."""
    out = []
    parent = ROOT_IDENTITY
    for token in token_ids:
        parent = identity(parent, token)
        out.append(parent)
    return out


class FakeDevice:
    """A KV cache of prefix identities and a deterministic sampler; reads only the arrays."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv = np.zeros(num_blocks * block_size, dtype=object)

    def step(self, desc: BatchDescriptor) -> np.ndarray:
        """Runs one step; returns [S] sampled tokens (padding rows: -1)."""
        tile = desc.token_ids.shape[0] // desc.block_tables.shape[0]
        size = self.block_size
        row_identity = {}
        for g in range(desc.block_tables.shape[0]):
            table = desc.block_tables[g]
            for row in range(g * tile, (g + 1) * tile):
                slot = int(desc.slot_mapping[row])
                if slot < 0:
                    continue
                pos = int(desc.positions[row])
                assert pos < desc.context_lens[g], "a token beyond its tile's context"
                if pos == 0:
                    parent = ROOT_IDENTITY
                else:
                    prev = pos - 1
                    parent = self.kv[int(table[prev // size]) * size + prev % size]
                value = identity(parent, desc.token_ids[row])
                assert slot == int(table[pos // size]) * size + pos % size
                self.kv[slot] = value
                row_identity[row] = value
        sampled = np.full(desc.sample_indices.shape[0], -1, dtype=np.int64)
        for i in range(desc.num_seqs):
            sampled[i] = next_token(row_identity[int(desc.sample_indices[i])])
        return sampled


class Harness:
    """A scheduler, a batch builder and a fake device, stepped together with integrity checks."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.builder = BatchBuilder(scheduler.config)
        self.device = FakeDevice(scheduler.config.num_blocks, scheduler.config.block_size)
        self.finished: list[Sequence] = []

    def step(self, before_update=None) -> tuple[BatchDescriptor | None, list[Sequence]]:
        """schedule -> build -> fake device -> update; checks the contract and integrity."""
        batch = self.scheduler.schedule()
        self.scheduler.check_integrity()
        if batch is None:
            return None, []
        desc = self.builder.build(batch)
        assert_descriptor_contract(desc, self.scheduler.config)
        sampled = self.device.step(desc)
        if before_update is not None:
            before_update(desc)
        for seq, append, token in zip(desc.seqs, desc.appends, sampled, strict=False):
            if append and not seq.is_finished:
                assert token == next_token(expected_identities(seq.token_ids)[-1]), (
                    f"{seq} sampled from the wrong KV"
                )
        finished = self.scheduler.update(batch, sampled)
        self.scheduler.check_integrity()
        self.finished.extend(finished)
        return desc, finished

    def run(self, max_steps: int = 1000) -> int:
        """Steps until nothing is left; returns the number of steps."""
        for steps in range(max_steps):
            if not self.scheduler.has_unfinished():
                return steps
            desc, _ = self.step()
            assert desc is not None, "unfinished requests but nothing scheduled: a hang"
        raise AssertionError(f"not done after {max_steps} steps")


def assert_descriptor_contract(desc: BatchDescriptor, config: SchedulerConfig) -> None:
    """The layout of `jaxllm.model.inputs`, checked row by row against the host's record."""
    shape = desc.shape
    num_tokens, num_tiles, num_sampled, width = shape[1:]
    assert desc.token_ids.shape == desc.positions.shape == desc.slot_mapping.shape == (num_tokens,)
    assert desc.block_tables.shape == (num_tiles, width)
    assert desc.context_lens.shape == (num_tiles,)
    for name in ("sample_indices", "temperature", "top_k", "top_p", "min_p", "seeds"):
        assert getattr(desc, name).shape == (num_sampled,), name
    for name in ("token_ids", "positions", "slot_mapping", "block_tables", "context_lens"):
        assert getattr(desc, name).dtype == np.int32, name
    assert desc.seeds.dtype == np.uint32 and desc.temperature.dtype == np.float32
    if shape.kind == "decode":
        assert num_tokens == num_tiles == num_sampled
        tile = 1
    else:
        assert num_tiles == num_sampled and num_tokens <= config.max_num_batched_tokens
        tile = config.prefill_tile
        assert num_tokens == num_tiles * tile
    size = config.block_size
    real_rows = set()
    row = 0
    for i, (seq, start, count) in enumerate(
        zip(desc.seqs, desc.batch.start_positions, desc.batch.num_new_tokens, strict=True)
    ):
        padded = -(-count // tile) * tile
        pad = padded - count
        for k in range(count):
            r = row + pad + k
            pos = start + k
            real_rows.add(r)
            assert desc.positions[r] == pos and desc.token_ids[r] == seq.token_ids[pos]
            assert desc.slot_mapping[r] == seq.block_table[pos // size] * size + pos % size
        for g in range(row // tile, (row + padded) // tile):
            last_pos = desc.positions[(g + 1) * tile - 1]
            assert desc.context_lens[g] == last_pos + 1
            used = -(-int(desc.context_lens[g]) // size)
            assert list(desc.block_tables[g, :used]) == seq.block_table[:used]
        assert desc.sample_indices[i] == row + padded - 1
        assert desc.sample_steps[i] == seq.num_output_tokens
        assert desc.query_starts[i] == row + pad and desc.query_lens[i] == count
        row += padded
    assert row // tile <= num_tiles
    for r in range(num_tokens):
        if r not in real_rows:
            assert desc.slot_mapping[r] == -1 and desc.token_ids[r] == 0
    # The model writes the step's K/V with a scatter that assumes distinct slots.
    slots = desc.slot_mapping[desc.slot_mapping >= 0]
    assert len(set(slots.tolist())) == len(slots)
    assert not desc.context_lens[row // tile :].any()
    assert not desc.sample_indices[desc.num_seqs :].any()
