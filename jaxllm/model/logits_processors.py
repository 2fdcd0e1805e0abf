"""Penalties, logit bias, allowed tokens and bad words, applied on the device in vLLM's order.

A sequence that asks for any of them holds a *slot*: one row of each `ProcessorState` array,
written whole when it is admitted (`write_slot`, from what the host knows), then kept on the
device: each step adds the sampled tokens to their rows' counts (`count_tokens`). A step's
`rows` [S] name each sampled row's slot, -1 for a row that asks for none (left unchanged).

vLLM's order and formulas, on float32 logits, in `process`:
1. the bias row: `logit_bias`, -inf outside `allowed_token_ids` and at banned bad-word tokens;
2. repetition penalty r over tokens in the prompt or the output: a positive logit divided by r,
   a negative one multiplied by it;
3. frequency penalty f and presence penalty p over the output: logit -= f * count + p * (count
   > 0).
A row left with no token to sample (its allowed tokens and its grammar's mask exclude every one)
keeps the logits it came with, masked by the grammar.

Structured outputs' token masks (`apply_bitmask`) come first: applied here in a step with
processors or logprobs, which read the masked logits, else inside the sampler's program.

Legend: R slots, V vocab, S sampled rows.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model.inputs import FREQUENCY, IN_PROMPT, PRESENCE, REPETITION
from jaxllm.model.qwen3 import DEFAULT_OPTIMIZATION


class ProcessorState(NamedTuple):
    """The slots' rows on the device.

    Attributes:
        tokens: [R, V] int32: each token's count in the output, `IN_PROMPT` added where it is
            in the prompt.
        bias: [R, V] float32 added to the logits (-inf bans a token).
        penalties: [R, 3] float32 presence, frequency and repetition penalty.
    """

    tokens: jax.Array
    bias: jax.Array
    penalties: jax.Array

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> ProcessorState:
        return cls(
            jnp.zeros((num_slots, vocab_size), jnp.int32),
            jnp.zeros((num_slots, vocab_size), jnp.float32),
            jnp.zeros((num_slots, 3), jnp.float32),
        )


def write_slot(
    state: ProcessorState, slot: jax.Array, tokens: jax.Array, bias: jax.Array, penalties
) -> ProcessorState:
    """The state with slot `slot` ([] int32) holding these rows ([V], [V], [3])."""
    return ProcessorState(
        state.tokens.at[slot].set(tokens),
        state.bias.at[slot].set(bias),
        state.penalties.at[slot].set(penalties),
    )


def edit_bias(
    state: ProcessorState, slots: jax.Array, tokens: jax.Array, values: jax.Array
) -> ProcessorState:
    """The state with bias[slots[i], tokens[i]] = values[i] ([E] each); slot -1 edits nothing."""
    slots = jnp.where(slots >= 0, slots, state.bias.shape[0])  # out of bounds: dropped
    return state._replace(bias=state.bias.at[slots, tokens].set(values, mode="drop"))


def count_tokens(state: ProcessorState, rows: jax.Array, tokens: jax.Array) -> ProcessorState:
    """The state with each sampled token ([S]) counted once more in its row's slot (`rows`
    [S], -1: none)."""
    slots = jnp.where(rows >= 0, rows, state.tokens.shape[0])  # out of bounds: dropped
    return state._replace(tokens=state.tokens.at[slots, tokens].add(1, mode="drop"))


def process(logits: jax.Array, state: ProcessorState, rows: jax.Array) -> jax.Array:
    """[S, V] float32 logits with each row's bias and penalties applied (rows [S], -1: none)."""
    logits = logits.astype(jnp.float32)
    slots = jnp.maximum(rows, 0)
    tokens = state.tokens[slots]  # [S, V]
    penalties = state.penalties[slots]  # [S, 3]
    counts = tokens & (IN_PROMPT - 1)
    seen = tokens > 0
    bias = state.bias[slots]
    processed = logits + bias
    repetition = jnp.where(seen, penalties[:, REPETITION, None], 1.0)
    processed = jnp.where(processed > 0, processed / repetition, processed * repetition)
    processed -= penalties[:, FREQUENCY, None] * counts
    processed -= penalties[:, PRESENCE, None] * (counts > 0)
    # NOTE: a banned token stays banned whatever the penalties (-inf * a penalty that rounds
    # to 0 in float32 would be NaN).
    processed = jnp.where(bias == -jnp.inf, -jnp.inf, processed)
    # A row whose bans leave nothing to sample (allowed tokens the grammar's mask excludes)
    # samples from the logits it came with: the grammar wins.
    emptied = jnp.all(processed == -jnp.inf, axis=-1, keepdims=True)
    return jnp.where((rows[:, None] >= 0) & ~emptied, processed, logits)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """[S, V] logits, -inf at each token t whose bit (t % 32 of word t // 32) is clear in its
    row's bitmask [S, ceil(V / 32)] int32 (llguidance's layout)."""
    num_rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, V / 32, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


# Bias edits travel in chunks of this many (one shape to compile).
EDIT_CHUNK = 64


class LogitsProcessors:
    """The slots' state on the device, allocated when a step first asks for processing, and
    the programs over it, compiled then (no start-up cost for engines that never see a
    penalty); the program applying token masks, compiled when first used; and the token
    bitmasks as the programs take them (`bitmask`).

    Args:
        num_slots, vocab_size: the state's shape ([R, V]).
        sharding: where the state and the logits live (replicated over the mesh).
        on_devices: host array -> what the programs take (global arrays with several
            processes).
        row_sizes: the sampled rows of every bucket, whose programs the first use compiles
            all at once (so that no later step waits for a compile); empty: each when needed.
        num_tokens: the rows of every step's sampled tokens (`ModelRunner.max_sampled_rows`).

    Mutates: `apply` and `count` replace `state` by the updated, donated one; `reset` drops it.
    """

    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        sharding,
        on_devices,
        row_sizes: tuple[int, ...] = (),
        num_tokens: int = 1,
    ) -> None:
        self.shape = (num_slots, vocab_size)
        self.mask_words = -(-vocab_size // 32)  # a token bitmask's int32 words a row
        self.state: ProcessorState | None = None
        self._sharding, self._on_devices = sharding, on_devices
        self._row_sizes, self._num_tokens = row_sizes, num_tokens
        jit = functools.partial(jax.jit, out_shardings=sharding)
        self._zeros = jit(functools.partial(ProcessorState.zeros, *self.shape))
        self._write = jit(write_slot, donate_argnums=0)
        self._edit = jit(edit_bias, donate_argnums=0)
        self._count = jit(
            lambda state, rows, tokens: count_tokens(state, rows[1], tokens[: rows.shape[1]]),
            donate_argnums=0,
        )
        # The programs over logits, each twice: keeping the logits, or writing over them.
        processed = lambda logits, state, rows: process(logits, state, rows[0])
        self._process = {donate: jit(processed, donate_argnums=(0,) * donate) for donate in (0, 1)}
        self._mask = {
            donate: jit(
                apply_bitmask, donate_argnums=(0,) * donate, compiler_options=DEFAULT_OPTIMIZATION
            )
            for donate in (0, 1)
        }
        self._executables: dict[tuple[int, bool], Any] = {}  # (rows, donate) -> process
        self._count_executables: dict[int, Any] = {}  # rows ->
        self._mask_executables: dict[tuple[int, bool], Any] = {}  # (rows, donate) ->
        self._every_token: dict[int, jax.Array] = {}  # rows -> a bitmask allowing every token

    def reset(self) -> None:
        self.state = None

    def _sizes(self, compiled: dict, num_rows: int, donate: bool) -> set[int]:
        """The row sizes to compile a program for: `num_rows`, and on the first use of the
        program (`donate` not among `compiled`'s keys) every size in `row_sizes`."""
        first = all(key[1] != donate for key in compiled)
        return {num_rows, *(self._row_sizes if first else ())}

    def _compile(self, num_rows: int, donate: bool) -> None:
        shaped = self._shaped
        state = jax.tree.map(lambda x: shaped(x.shape, x.dtype), jax.eval_shape(self._zeros))
        tokens = shaped((self._num_tokens,), jnp.int32)
        for size in self._sizes(self._executables, num_rows, donate):
            logits, rows = shaped((size, self.shape[1]), jnp.float32), shaped((2, size), jnp.int32)
            program = self._process[donate].lower(logits, state, rows)
            self._executables[size, donate] = program.compile()
            if size not in self._count_executables:
                program = self._count.lower(state, rows, tokens)
                self._count_executables[size] = program.compile()

    def apply(self, logits: jax.Array, plan, donate: bool = False) -> tuple[jax.Array, Any]:
        """A step's processed logits [S, V], after its slot writes and bias edits (`plan`: a
        `sched.processors.ProcessorPlan`), written over `logits` if `donate`; returns them
        and the rows to `count` with."""
        key = (logits.shape[0], donate)
        if self.state is None or key not in self._executables:
            # NOTE: kernels load on an idle device (`ModelRunner._compile_for` says why)
            jax.block_until_ready(logits)
        if self.state is None:
            self.state = self._zeros()
        for write in plan.writes:
            arrays = (np.array(write.slot, np.int32), write.tokens, write.bias, write.penalties)
            self.state = self._write(self.state, *map(self._on_devices, arrays))
        if plan.edits is not None:
            num_edits = len(plan.edits[0])
            padded = -(-num_edits // EDIT_CHUNK) * EDIT_CHUNK
            slots, tokens, values = (
                np.pad(array, (0, padded - num_edits), constant_values=fill)
                for array, fill in zip(plan.edits, (-1, 0, 0.0), strict=True)
            )
            for start in range(0, padded, EDIT_CHUNK):
                chunk = (a[start : start + EDIT_CHUNK] for a in (slots, tokens, values))
                self.state = self._edit(self.state, *map(self._on_devices, chunk))
        if key not in self._executables:
            self._compile(*key)
        rows = self._on_devices(plan.rows)
        return self._executables[key](logits, self.state, rows), rows

    def mask(self, logits: jax.Array, bitmask: np.ndarray, donate: bool = False) -> jax.Array:
        """[S, V] logits with the tokens the [S, ceil(V / 32)] bitmask clears set to -inf
        (`apply_bitmask`), written over `logits` if `donate`."""
        key = (logits.shape[0], donate)
        if key not in self._mask_executables:
            for size in self._sizes(self._mask_executables, *key):
                lowered = self._mask[donate].lower(
                    self._shaped((size, self.shape[1]), logits.dtype),
                    self._shaped((size, bitmask.shape[1]), jnp.int32),
                )
                self._mask_executables[size, donate] = lowered.compile()
        return self._mask_executables[key](logits, self._on_devices(bitmask))

    def bitmask(self, num_rows: int, bitmask: np.ndarray | None) -> jax.Array | np.ndarray:
        """A host [S, ceil(V / 32)] token bitmask as the programs take it; None: one allowing
        every token, kept on the devices."""
        if bitmask is not None:
            return self._on_devices(bitmask)
        if num_rows not in self._every_token:
            every = np.full((num_rows, self.mask_words), -1, np.int32)
            self._every_token[num_rows] = jax.device_put(self._on_devices(every), self._sharding)
        return self._every_token[num_rows]

    def _shaped(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._sharding)

    def count(self, rows, tokens: jax.Array) -> None:
        """Counts a step's sampled tokens ([max_sampled_rows]) in their rows' slots."""
        self.state = self._count_executables[rows.shape[1]](self.state, rows, tokens)
