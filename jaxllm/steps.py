"""The programs of one engine step, as `ModelRunner` compiles them, and the packing of their
host inputs.

A step's inputs travel packed into one int32 array (`pack`), unpacked inside the program;
`previous_rows` names the rows whose input token the previous step sampled on the device.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.model.inputs import ModelInputs, SamplingInputs
from jaxllm.model.logits_processors import apply_bitmask
from jaxllm.model.qwen3 import COMPILER_OPTIONS
from jaxllm.model.sampler import processed_logits, sample, token_logprobs
from jaxllm.model.sharding import replicated
from jaxllm.sched import Bucket, StepPlan


def pack(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """Host arrays of 4-byte dtypes as one flat int32 array. NOTE: each array handed to an
    executable is a transfer of its own, tens of microseconds of the host's time per step."""
    parts = []
    for index, array in enumerate(arrays):
        array = np.asarray(array)
        if array.dtype.itemsize != 4:
            raise ValueError(f"array {index} is {array.dtype}: only 4-byte dtypes are packed")
        parts.append(array.reshape(-1).view(np.int32))
    return np.concatenate(parts)


def unpack(packed: jax.Array, like: Sequence[np.ndarray]) -> list[jax.Array]:
    """The inverse of `pack`, traced: arrays of the shapes and dtypes of `like`."""
    arrays, offset = [], 0
    for array in like:
        part = packed[offset : offset + array.size].reshape(array.shape)
        dtype = jnp.dtype(array.dtype)
        arrays.append(part if dtype == jnp.int32 else lax.bitcast_convert_type(part, dtype))
        offset += array.size
    return arrays


def previous_rows(plan: StepPlan, previous: StepPlan | None) -> np.ndarray:
    """[T] for each decode row of `plan` whose input token `previous` sampled, its row in that
    step's output; -1 elsewhere. NOTE: the engine plans a step before it reads the previous
    one's tokens, so such a token may not be on the host yet (the plan holds 0 for it); prefill
    chunks never hold one."""
    rows = np.full(plan.bucket.num_tokens, -1, np.int32)
    if previous is None or plan.is_prefill:
        return rows
    sampled_at = {  # seq_id -> (row, the position of the token it samples)
        seq.seq_id: (row, previous.start_positions[row] + previous.num_new_tokens[row])
        for row, seq in enumerate(previous.seqs)
        if previous.samples[row]
    }
    for row, (seq, start) in enumerate(zip(plan.seqs, plan.start_positions, strict=True)):
        source = sampled_at.get(seq.seq_id)
        if source is not None and source[1] == start:
            rows[row] = source[0]
    return rows


def padding_step(bucket: Bucket) -> tuple[np.ndarray, ...]:
    """A step of padding alone, as the bucket's executable takes it (before packing): the
    model's inputs, `previous_rows` (-1: none), and for several steps each one's slots."""
    inputs, _ = bucket.padding()
    rows = np.full(bucket.num_tokens, -1, np.int32)
    if bucket.num_steps == 1:
        return (*inputs, rows)
    return (*inputs, rows, np.full((bucket.num_steps, bucket.num_tokens), -1, np.int32))


def packed_size(bucket: Bucket) -> int:
    """The size of a step's packed inputs (`pack(padding_step(bucket))`)."""
    return sum(map(np.size, padding_step(bucket)))


def settings_size(num_rows: int) -> int:
    """The size of `num_rows` sampled rows' packed `SamplingInputs`."""
    return sum(map(np.size, SamplingInputs.padding(num_rows)))


def programs(forward, mesh, kernels, max_sampled_rows, num_top: int, processed: bool, mailbox):
    """The jitted programs `ModelRunner` compiles, of the sharded model step `forward`: the
    forward pass, several decode steps (with `mailbox`, a `handoff.Mailbox`, where it is not
    None), the logprobs and the sampler. NOTE: tokens for the host are written to its memory by
    their program (read in 0.04 ms, not 0.38)."""
    host, devices = replicated(mesh, "pinned_host"), replicated(mesh)
    sampling = dict(num_rows=max_sampled_rows, fused_argmax=kernels.fused_argmax)
    return (
        jax.jit(functools.partial(forward_step, forward), static_argnames="bucket",
                donate_argnums=1, compiler_options=COMPILER_OPTIONS),
        jax.jit(functools.partial(decode_steps, forward, handoff=mailbox, **sampling),
                static_argnames=("bucket", "mode"), donate_argnums=1,
                out_shardings=(host, devices, None), compiler_options=COMPILER_OPTIONS),
        jax.jit(functools.partial(logprob_step, num_rows=max_sampled_rows, num_top=num_top,
                                  processed=processed), out_shardings=devices),
        jax.jit(functools.partial(sample_step, **sampling), static_argnames="mode",
                out_shardings=(devices, host)),
    )  # fmt: skip


def forward_step(forward_fn, params, kv_cache, packed, previous_tokens, *, bucket: Bucket):
    """The model step; `packed` holds its inputs, then `previous_rows`: a row naming a row of
    the previous step's sampled tokens takes that token as its token id."""
    *arrays, rows = unpack(packed, padding_step(bucket))
    inputs = ModelInputs(*arrays)
    token_ids = jnp.where(rows >= 0, previous_tokens[jnp.maximum(rows, 0)], inputs.token_ids)
    return forward_fn(params, kv_cache, inputs._replace(token_ids=token_ids))


def sample_step(logits, packed, bitmask, *, num_rows: int, mode: str, fused_argmax: bool):
    """Samples [S] tokens under the [S, ceil(V / 32)] token `bitmask` (structured outputs; all
    bits set elsewhere), padded to `num_rows`, so every step's result has one shape. Returns
    them twice: for the next step on the devices, and for the host (`ModelRunner` places that
    copy in host memory)."""
    sampling = SamplingInputs(*unpack(packed, SamplingInputs.padding(logits.shape[0])))
    logits = apply_bitmask(logits, bitmask)
    tokens = sample(logits, sampling, mode=mode, fused_argmax=fused_argmax)
    tokens = jnp.pad(tokens, (0, num_rows - logits.shape[0]))
    return tokens, tokens


def decode_steps(
    forward_fn,
    params,
    kv_cache,
    packed,
    packed_sampling,
    previous_tokens,
    mailbox=None,
    *,
    bucket,
    mode,
    num_rows,
    fused_argmax,
    handoff=None,
):
    """A decode plan's K steps in one program: each step's sampled tokens are the next one's
    inputs, at the next position, and its KV goes to the slots the host gave (`step_slots`).
    With `mailbox` (the plan's base tag, then the flag, masks and outbox of `handoff`, a
    `handoff.Mailbox`) each step samples under its own [S, ceil(V / 32)] token bitmask, from the
    host, which gets each step's tokens (structured outputs). Returns the tokens of every step
    [K, num_rows] (for the host), those of the last [num_rows] (for the next plan), the cache."""
    *arrays, rows, slots = unpack(packed, padding_step(bucket))
    inputs = ModelInputs(*arrays)
    sampling = SamplingInputs(*unpack(packed_sampling, bucket.padding()[1]))
    token_ids = jnp.where(rows >= 0, previous_tokens[jnp.maximum(rows, 0)], inputs.token_ids)

    def step(j, carry):
        kv_cache, token_ids, tokens = carry
        step_inputs = inputs._replace(
            token_ids=token_ids,
            positions=inputs.positions + j,
            slot_mapping=slots[j],
            # NOTE: a row past its steps (slot -1 after the first), like padding, attends to
            # nothing: its context would run past its block table
            context_lens=jnp.where(slots[j] >= 0, inputs.context_lens + j, 0),
        )
        logits, kv_cache = forward_fn(params, kv_cache, step_inputs)
        if mailbox is not None:
            tag, flag, masks, outbox = mailbox
            mask = handoff.wait(tag + 1 + j, logits, flag, masks)
            logits = apply_bitmask(logits, mask.reshape(bucket.num_sampled, -1))
        step_sampling = sampling._replace(steps=sampling.steps + j)
        sampled = sample(logits, step_sampling, mode=mode, fused_argmax=fused_argmax)
        if mailbox is not None:
            sampled = handoff.publish(sampled, tag + 1 + j, outbox)
        return kv_cache, sampled, tokens.at[j].set(sampled)

    tokens = jnp.zeros((bucket.num_steps, bucket.num_sampled), jnp.int32)
    kv_cache, last, tokens = lax.fori_loop(0, bucket.num_steps, step, (kv_cache, token_ids, tokens))
    padding = num_rows - bucket.num_sampled
    return jnp.pad(tokens, ((0, 0), (0, padding))), jnp.pad(last, (0, padding)), kv_cache


def logprob_step(logits, tokens, packed, *, num_rows: int, num_top: int, processed: bool):
    """`sampler.token_logprobs` of a step's sampled rows, padded to `num_rows` rows: of the token
    each row sampled, or of its target where that is >= 0 (a prompt token). `packed` holds the
    targets [S], then the rows' `SamplingInputs`; `processed`: of the logits each row samples
    from (`sampler.processed_logits`), not the raw ones; a prompt token's, raw either way."""
    num_sampled = logits.shape[0]
    like = (np.zeros(num_sampled, np.int32), *SamplingInputs.padding(num_sampled))
    targets, *sampling = unpack(packed, like)
    if processed:  # NOTE: a prompt token's row (no processor, no mask applied) is raw
        sampled = processed_logits(logits, SamplingInputs(*sampling))
        logits = jnp.where((targets >= 0)[:, None], logits.astype(sampled.dtype), sampled)
    chosen = jnp.where(targets >= 0, targets, tokens[:num_sampled])
    values = token_logprobs(logits, chosen, num_top)
    return jnp.pad(values, ((0, num_rows - num_sampled), (0, 0)))


class StepResult(NamedTuple):
    """What `ModelRunner.execute` hands back, not waited for.

    Attributes:
        tokens: [max_sampled_rows] int32 sampled tokens in host memory, row i the token of
            `plan.seqs[i]` (rows past the plan's are 0); a plan of K > 1 decode steps:
            [K, max_sampled_rows].
        logprobs: for a plan with `plan.logprobs`, [max_sampled_rows, 2 + 2 * max_logprobs]
            (`sampler.token_logprobs`); else None.
        kept: for a plan whose steps took their masks from the mailbox, the future of the
            tokens each constrained row keeps (`handoff.StepwiseMasks.kept`); else None.
    """

    tokens: jax.Array
    logprobs: jax.Array | None = None
    kept: concurrent.futures.Future | None = None


def write_inputs(
    into: tuple[jax.Array, ...], packed: jax.Array, previous_tokens: jax.Array
) -> tuple[jax.Array, ...]:
    """`packed` (a forward pass's packed inputs, then its sampler's settings) and the previous
    step's tokens written into `into`'s buffers (of the inputs, the settings, the tokens;
    donated to the program, so updated in place)."""
    size = into[0].shape[0]
    new = (packed[:size], packed[size:], previous_tokens)
    return tuple(
        lax.dynamic_update_slice(buffer, values, (0,))
        for buffer, values in zip(into, new, strict=True)
    )


class FixedInputs:
    """A one-step plan's host inputs (the forward pass's packed arrays and the previous step's
    tokens, the sampler's packed settings), where `enabled`, written by a program of their own
    (`write_inputs`, one per pair of sizes) in one transfer into buffers that keep their device
    addresses, so that XLA launches the programs' CUDA graphs as recorded. NOTE: XLA updates a
    graph whose arguments moved before launching it: 0.42 ms of a 1.5 ms forward call at one
    row on an H100, traced; an executable's host array costs a transfer, ~0.1 ms of a sampler
    call's 0.17 (docs/performance.md).

    Args:
        sharding: the buffers' (replicated over the mesh).
        on_devices: a host array as the programs take it (`ModelRunner._on_devices`).
        enabled: `Kernels.fixed_inputs`; else the inputs are passed as they are.
    """

    def __init__(self, sharding: jax.sharding.Sharding, on_devices: Callable, enabled: bool):
        self.enabled = enabled
        self.write = jax.jit(write_inputs, donate_argnums=0, out_shardings=sharding)
        self.executables: dict[tuple[int, int], jax.stages.Compiled] = {}  # by sizes, compiled
        self._buffers: dict[tuple[int, int], tuple[jax.Array, ...]] = {}
        self._on_devices = on_devices

    def __call__(
        self, packed: np.ndarray, settings: np.ndarray, previous_tokens: jax.Array
    ) -> tuple[jax.Array, ...]:
        """The forward pass's packed inputs, the sampler's settings and the previous tokens as
        their programs take them: where enabled, in the buffers of their sizes."""
        if not self.enabled:
            return self._on_devices(packed), self._on_devices(settings), previous_tokens
        sizes = (len(packed), len(settings))
        into = self._buffers.get(sizes)
        if into is None:
            zeros = (np.zeros(size, np.int32) for size in (*sizes, len(previous_tokens)))
            into = tuple(map(self._on_devices, zeros))
        new = self._on_devices(np.concatenate([packed, settings]))
        self._buffers[sizes] = self.executables[sizes](into, new, previous_tokens)
        return self._buffers[sizes]

    def reset(self) -> None:
        """Drops the buffers (a failed step may have deleted them by donation)."""
        self._buffers.clear()
