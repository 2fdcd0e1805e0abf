"""Factories, a fake device and the step plan's contract for the scheduler tests (pure Python +
numpy).

`FakeDevice` stands in for the model. It keeps one value per KV slot: the identity of the token
at that position *and of everything before it*, computed the way attention would, by reading
the previous position's slot through the tile's block table. The token it samples is a function
of that identity. So a wrong block table, slot mapping, position, tile layout or prefix-cache hit
changes the identities and shows up as a wrong token, as a real model's garbage would.
"""

from __future__ import annotations

import numpy as np

from jaxllm.sampling_params import SamplingParams
from jaxllm.sched import Scheduler, SchedulerConfig, Sequence, StepPlan

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
    scheduler: Scheduler,
    prompt: int | list[int],
    max_tokens: int = 4,
    stop_strings=None,
    **params,
) -> Sequence:
    """Adds a request; an int prompt means `list(range(100, 100 + prompt))`."""
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("ignore_eos", True)
    params = SamplingParams(max_tokens=max_tokens, **params)
    seq = scheduler.new_sequence(tokens, params, stop_strings)
    scheduler.add(seq)
    return seq


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

    def step(self, plan: StepPlan, token_ids: np.ndarray | None = None) -> np.ndarray:
        """Runs one step (with these token ids instead of the plan's, if given); returns [S]
        sampled tokens (padding rows: -1), or [K, S] for a plan of K decode steps."""
        inputs = plan.inputs
        token_ids = inputs.token_ids if token_ids is None else token_ids
        if plan.bucket.num_steps == 1:
            return self._step(plan.num_seqs, inputs, token_ids)
        steps = []
        for j in range(plan.bucket.num_steps):
            step_inputs = inputs._replace(
                positions=inputs.positions + j,
                slot_mapping=plan.step_slots[j],
                context_lens=np.where(plan.step_slots[j] >= 0, inputs.context_lens + j, 0),
            )
            steps.append(self._step(plan.num_seqs, step_inputs, token_ids))
            token_ids = np.zeros_like(token_ids)
            token_ids[: plan.num_seqs] = steps[-1][: plan.num_seqs]
        return np.stack(steps)

    def _step(self, num_seqs: int, inputs, token_ids: np.ndarray) -> np.ndarray:
        tile = inputs.tile_size
        size = self.block_size
        row_identity = {}
        for g in range(inputs.block_tables.shape[0]):
            table = inputs.block_tables[g]
            assert inputs.context_lens[g] <= len(table) * size, "a context past its table"
            for row in range(g * tile, (g + 1) * tile):
                slot = int(inputs.slot_mapping[row])
                if slot < 0:
                    continue
                pos = int(inputs.positions[row])
                assert pos < inputs.context_lens[g], "a token beyond its tile's context"
                if pos == 0:
                    parent = ROOT_IDENTITY
                else:
                    prev = pos - 1
                    parent = self.kv[int(table[prev // size]) * size + prev % size]
                value = identity(parent, token_ids[row])
                assert slot == int(table[pos // size]) * size + pos % size
                self.kv[slot] = value
                row_identity[row] = value
        sampled = np.full(inputs.sample_indices.shape[0], -1, dtype=np.int64)
        for i in range(num_seqs):
            row = int(inputs.sample_indices[i])
            if row in row_identity:  # not a row past its sequence's steps
                sampled[i] = next_token(row_identity[row])
        return sampled


class Harness:
    """A scheduler and a fake device, stepped together with integrity checks."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.device = FakeDevice(scheduler.config.num_blocks, scheduler.config.block_size)
        self.finished: list[Sequence] = []

    def step(self, before_update=None) -> tuple[StepPlan | None, list[Sequence]]:
        """schedule -> fake device -> update; checks the plan's contract and integrity."""
        plan = self.scheduler.schedule()
        self.scheduler.check_integrity()
        if plan is None:
            return None, []
        assert_plan_contract(plan, self.scheduler.config)
        sampled = self.device.step(plan)
        if before_update is not None:
            before_update(plan)
        first = sampled if sampled.ndim == 1 else sampled[0]
        for seq, samples, token in zip(plan.seqs, plan.samples, first, strict=False):
            if samples and not seq.is_finished:
                assert token == next_token(expected_identities(seq.token_ids)[-1]), (
                    f"{seq} sampled from the wrong KV"
                )
        finished = self.scheduler.update(plan, sampled)
        self.scheduler.check_integrity()
        self.finished.extend(finished)
        return plan, finished

    def run(self, max_steps: int = 1000) -> int:
        """Steps until nothing is left; returns the number of steps."""
        for steps in range(max_steps):
            if not self.scheduler.has_unfinished():
                return steps
            plan, _ = self.step()
            assert plan is not None, "unfinished requests but nothing scheduled: a hang"
        raise AssertionError(f"not done after {max_steps} steps")


def assert_plan_contract(plan: StepPlan, config: SchedulerConfig) -> None:
    """The layout of `jaxllm.model.inputs`, checked row by row against the plan's record (a
    synchronous step: every input token is on the host)."""
    inputs, sampling = plan.inputs, plan.sampling
    num_tokens, num_tiles, num_sampled, width = plan.bucket[1:5]
    assert inputs.token_ids.shape == inputs.positions.shape == (num_tokens,)
    assert inputs.slot_mapping.shape == (num_tokens,)
    assert inputs.block_tables.shape == (num_tiles, width)
    assert inputs.context_lens.shape == (num_tiles,)
    assert inputs.sample_indices.shape == (num_sampled,)
    for name, array in sampling._asdict().items():
        assert array.shape == (num_sampled,), name
    for name, array in inputs._asdict().items():
        assert array.dtype == np.int32, name
    assert sampling.seeds.dtype == np.uint32 and sampling.temperature.dtype == np.float32
    if plan.bucket.kind == "decode":
        assert num_tokens == num_tiles == num_sampled
        tile = 1
    else:
        assert num_tiles == num_sampled and num_tokens <= config.max_num_batched_tokens
        tile = config.prefill_tile
        assert num_tokens == num_tiles * tile
    size = config.block_size
    real_rows = set()
    row = 0
    num_steps = plan.bucket.num_steps
    for i, (seq, start, own_steps) in enumerate(
        zip(plan.seqs, plan.start_positions, plan.num_new_tokens, strict=True)
    ):
        count = 1 if num_steps > 1 else own_steps  # a row per step of a decode plan
        padded = -(-count // tile) * tile
        pad = padded - count
        # NOTE: the plan's table, as planned: since, a sequence whose last token this plan
        # samples gave its blocks back, and a block computed twice in one step was merged into
        # the cached one (the fake device checks that every token read the right K/V).
        table = inputs.block_tables[row // tile].tolist()
        assert len(table) >= -(-(start + own_steps) // size)
        for j in range(1, num_steps):  # the later steps' slots: -1 past the row's own steps
            pos = start + j
            expected = table[pos // size] * size + pos % size if j < own_steps else -1
            assert plan.step_slots[j, row] == expected
        for k in range(count):
            r = row + pad + k
            pos = start + k
            real_rows.add(r)
            assert inputs.positions[r] == pos and inputs.token_ids[r] == seq.token_ids[pos]
            assert inputs.slot_mapping[r] == table[pos // size] * size + pos % size
        for g in range(row // tile, (row + padded) // tile):
            last_pos = inputs.positions[(g + 1) * tile - 1]
            assert inputs.context_lens[g] == last_pos + 1
            used = -(-int(inputs.context_lens[g]) // size)
            assert list(inputs.block_tables[g, :used]) == table[:used]
        assert inputs.sample_indices[i] == row + padded - 1
        if plan.samples[i]:
            assert sampling.steps[i] == seq.num_output_tokens
        row += padded
    assert row // tile <= num_tiles
    for r in range(num_tokens):
        if r not in real_rows:
            assert inputs.slot_mapping[r] == -1 and inputs.token_ids[r] == 0
    # The model writes the step's K/V with a scatter that assumes distinct slots.
    slots = inputs.slot_mapping[inputs.slot_mapping >= 0]
    assert len(set(slots.tolist())) == len(slots)
    assert not inputs.context_lens[row // tile :].any()
    assert not inputs.sample_indices[plan.num_seqs :].any()
