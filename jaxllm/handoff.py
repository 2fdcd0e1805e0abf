"""Constrained rows in decode plans of several steps, every step under its own token mask: the
program hands each step's tokens to the host and waits, on the device, for the mask the host
fills from them while the next step's forward pass runs (one device: `DeviceMailbox` on NVIDIA
GPUs, as below; `HostMailbox`, the same steps through host callbacks, on a CPU in tests).

Two device buffers make the mailbox of a plan's rows, at addresses fixed once allocated: the
outbox, where a Pallas kernel (`publish`) stores each sampled token as one int32 word with its
step's tag, and the masks with their flag, where another (`wait_for_mask`) spins until the flag
holds its step's tag before it copies the masks out for the sampler. On the host a thread
polls the outbox through the CUDA driver on a stream of its own, advances the rows' grammars
(`StepwiseMasks`), then writes the next step's masks and, after them, the flag (after a plan's
last step, the next plan's first). XLA's stream never waits for the host, the device only where
the host is late.
A wait that spins `SPIN_LIMIT` polls gives up (its step samples unmasked): a host that died
cannot hang the device. Tags name a plan and its step, so no step reads another's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.structured import consume_tokens, fill_masks, grammar_rows

# A published token's word: its step's tag << TOKEN_BITS | the token (vocabularies < 2 ** 18).
TOKEN_BITS = 18
# Tags: a plan's base (PLAN_TAGS of them, in turn), plus 1 + its step (< STEP_TAGS steps).
PLAN_TAGS, STEP_TAGS = 128, 64
# The flag: the tag repeated, so that a wait sees it whole (all words equal).
FLAG_WORDS = 8
# NOTE: a poll is one load from the L2 cache, ~1 us: a wait gives up after seconds.
SPIN_LIMIT = 1 << 22
# The longest the host waits for a step's tokens (the device failed), in seconds.
HOST_TIMEOUT = 60.0


def _publish_kernel(tokens_ref, tag_ref, outbox_ref, out_ref):
    tokens = tokens_ref[...]
    # NOTE: an input written in place: the host reads the outbox while the program runs
    outbox_ref[...] = jnp.max(tag_ref[...]) * (1 << TOKEN_BITS) + tokens
    out_ref[...] = tokens


def publish(tokens: jax.Array, tag: jax.Array, outbox: jax.Array) -> jax.Array:
    """Stores `tokens` [S] with `tag` in `outbox` [P >= S, a power of two]; returns them (a
    later step that reads these runs after the store)."""
    padded = jnp.pad(tokens, (0, outbox.shape[0] - tokens.shape[0]))
    out = pl.pallas_call(
        _publish_kernel,
        out_shape=jax.ShapeDtypeStruct(outbox.shape, jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=1),
    )(padded, tag, outbox)
    return out[: tokens.shape[0]]


def _wait_kernel(tag_ref, after_ref, flag_ref, masks_ref, out_ref, *, block: int, size: int):
    del after_ref  # orders the wait after the step's forward pass
    want = jnp.max(tag_ref[...])

    def waiting(state):
        ready, polls = state
        return (ready == 0) & (polls < SPIN_LIMIT)

    def poll(state):
        flag = plgpu.load(flag_ref.at[pl.ds(0, FLAG_WORDS)], volatile=True)
        return jnp.min((flag == want).astype(jnp.int32)), state[1] + 1

    ready, _ = lax.while_loop(waiting, poll, (jnp.int32(0), jnp.int32(0)))
    start = pl.program_id(0) * block
    inside = start + jnp.arange(block) < size
    words = plgpu.load(masks_ref.at[pl.ds(start, block)], mask=inside, other=0, volatile=True)
    plgpu.store(out_ref.at[pl.ds(start, block)], jnp.where(ready == 1, words, -1), mask=inside)


def wait_for_mask(tag: jax.Array, after: jax.Array, flag: jax.Array, masks: jax.Array):
    """The [S, W] masks the host wrote into `masks` (flat) once `flag` holds `tag`, waited for
    on the device after `after` is computed; all bits set if the wait gave up."""
    size = masks.shape[0]
    block = min(1024, 1 << (size.bit_length() - 1))
    kernel = functools.partial(_wait_kernel, block=block, size=size)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((size,), jnp.int32),
        grid=(pl.cdiv(size, block),),
        compiler_params=plgpu.CompilerParams(num_warps=4),
    )(tag, after, flag, masks)


class StepwiseMasks:
    """The masks of a plan of several decode steps whose every step samples under its own
    (`jaxllm.handoff`): every token a live row samples is kept (`after` counts them in `kept`).
    The first step's come from `Grammars.bitmask`, or from `first` on the mailbox's thread: once
    the plan before's last tokens are consumed, or else once `ready` is set (the plan before
    applied: the main thread reads the grammars until then); the grammars advance after it."""

    def __init__(self, plan, vocab_size: int) -> None:
        self._plan, self._live = plan, None
        self.kept: dict[int, int] = {}
        self.num_rows = plan.bucket.num_sampled
        self._mask = np.empty((self.num_rows, -(-vocab_size // 32)), np.int32)
        self.ready = threading.Event()

    def first(self) -> np.ndarray:
        """The first step's masks, as `Grammars.bitmask` fills them."""
        self._start()
        return self._filled()

    def after(self, step: int, tokens: np.ndarray) -> np.ndarray | None:
        """Advances the live rows' grammars past `tokens` [S], step `step`'s, and returns the
        next step's masks (every bit set in other rows, whose tokens are dropped); None after
        the plan's last step."""
        if self._live is None:  # the rows as `Grammars.bitmask` found them
            self._start()
        counts = self._plan.num_new_tokens
        live = [(row, grammar) for row, grammar in self._live if step < counts[row]]
        consume_tokens([(grammar, int(tokens[row])) for row, grammar in live])
        self.kept.update({row: self.kept[row] + 1 for row, _ in live})
        if step + 1 == self._plan.bucket.num_steps:
            return None
        self._live = [(row, g) for row, g in live if step + 1 < counts[row] and not g.is_terminated]
        return self._filled()

    def _start(self) -> None:
        # NOTE: a grammar may end in the plan before, not yet applied (its sequence unfinished)
        self._live = [(row, g) for row, g in grammar_rows(self._plan) if not g.is_terminated]
        self.kept = dict.fromkeys((row for row, _ in self._live), 0)

    def _filled(self) -> np.ndarray:
        self._mask[:] = -1
        fill_masks(self._live, self._mask)
        return self._mask


class Driver:
    """The CUDA driver calls of the host's side (ctypes), on a non-blocking stream of its own in
    JAX's context (the device's primary one)."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._check(self._lib.cuInit(0))
        device = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(device), 0))
        self._context = ctypes.c_void_p()
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), device))
        self.use()
        self._stream = ctypes.c_void_p()
        self._check(self._lib.cuStreamCreate(ctypes.byref(self._stream), 1))  # non-blocking

    def use(self) -> None:
        """Makes the context current on the calling thread."""
        self._check(self._lib.cuCtxSetCurrent(self._context))

    def write(self, address: int, host: np.ndarray) -> None:
        """Copies `host` (contiguous) to device memory at `address`, and waits."""
        device, pointer = ctypes.c_uint64(address), ctypes.c_void_p(host.ctypes.data)
        self._copy(self._lib.cuMemcpyHtoDAsync_v2, device, pointer, host.nbytes)

    def read(self, host: np.ndarray, address: int) -> None:
        """Copies device memory at `address` into `host` (contiguous), and waits."""
        device, pointer = ctypes.c_uint64(address), ctypes.c_void_p(host.ctypes.data)
        self._copy(self._lib.cuMemcpyDtoHAsync_v2, pointer, device, host.nbytes)

    def _copy(self, copy, to, source, nbytes: int) -> None:
        self._check(copy(to, source, ctypes.c_size_t(nbytes), self._stream))
        self._check(self._lib.cuStreamSynchronize(self._stream))

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"the CUDA driver returned error {status}")


@dataclasses.dataclass
class _Plan:
    """A plan opened in a mailbox, until its last step is answered (`kept`: `HostMailbox`'s)."""

    base: int  # its tag
    num_steps: int
    stepwise: StepwiseMasks
    boxes: tuple[jax.Array, jax.Array, jax.Array]  # flag, masks, outbox
    generation: int  # the mailbox's resets before it
    kept: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    answered: bool = False  # its first step's masks written (`DeviceMailbox`)


class Mailbox:
    """A runner's mailboxes, one per plan row count, and the handoff of its plans' steps.

    `open` writes a plan's first step's masks and gives the program's mailbox arguments;
    `follow`, once the program is dispatched, answers its later steps; the program calls
    `publish` and `wait` (traced). `DeviceMailbox` hands the tokens over through device memory
    (NVIDIA GPUs), `HostMailbox` through host callbacks (a CPU: the same steps, in tests).

    Args:
        sharding: the programs' (one device).
        mask_words: a token mask's words per row.
    """

    overlaps = False  # a plan may be dispatched before the one before is applied

    def __init__(self, sharding: jax.sharding.Sharding, mask_words: int) -> None:
        self._sharding, self._words = sharding, mask_words
        self._boxes: dict[int, tuple[jax.Array, jax.Array, jax.Array]] = {}
        self._plans = self._generation = 0
        self._opened: _Plan | None = None  # the last

    @staticmethod
    def of(kernels, mesh: jax.sharding.Mesh, vocab_size: int) -> Mailbox | None:
        """A runner's mailbox of the kind `kernels.mailbox` names, where it runs on one device;
        else None."""
        if kernels.mailbox is None or mesh.size > 1 or jax.process_count() > 1:
            return None
        kind = {"device": DeviceMailbox, "host": HostMailbox}[kernels.mailbox]
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return kind(sharding, -(-vocab_size // 32))

    def shapes(self, num_rows: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The shapes of `open`'s result for plans of `num_rows` sampled rows."""
        arrays = (np.zeros(FLAG_WORDS), *self.boxes(num_rows))
        shape = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32, sharding=self._sharding)
        return tuple(shape(array.shape) for array in arrays)

    def boxes(self, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The flag [FLAG_WORDS], masks [num_rows * words] and outbox [a power of two >=
        num_rows] of plans of `num_rows` sampled rows (allocated on first use)."""
        if num_rows not in self._boxes:
            sizes = (FLAG_WORDS, num_rows * self._words, 1 << (num_rows - 1).bit_length())
            self._boxes[num_rows] = tuple(
                jax.device_put(np.zeros(size, np.int32), self._sharding) for size in sizes
            )
        return self._boxes[num_rows]

    def open(self, first_mask: np.ndarray | None, num_steps: int, stepwise) -> tuple:
        """Opens a plan of `num_steps` under the next tag, whose steps' masks [S, words] come
        from `stepwise` (`StepwiseMasks`): the first step's from `stepwise.first()` on the
        mailbox's thread (`overlaps`), else `first_mask` (`HostMailbox`); a later step's from
        `stepwise.after(step, tokens)` of the step before's tokens. Returns the program's
        mailbox arguments: the plan's base tag, the flag, masks and outbox."""
        base = (self._plans % PLAN_TAGS) * STEP_TAGS
        self._plans += 1
        boxes = self.boxes(stepwise.num_rows)
        self._opened = _Plan(base, num_steps, stepwise, boxes, self._generation)
        return np.full(FLAG_WORDS, base, np.int32), *boxes

    def follow(self) -> concurrent.futures.Future:
        """Answers the steps of the plan opened last, now dispatched; returns the future of its
        `stepwise.kept`, every step's tokens consumed."""
        return self._opened.kept

    def reset(self) -> None:
        """Ends the answering of the plans in flight (a failed step)."""
        self._generation += 1


class DeviceMailbox(Mailbox):
    """The tokens and masks through device memory: Pallas kernels on the device, the CUDA
    driver's copies on a stream of the host's own, answered by a thread."""

    publish = staticmethod(publish)
    wait = staticmethod(wait_for_mask)
    # NOTE: a plan is dispatched while the one before runs and the thread fills its first masks
    # once it has that one's last tokens: the device does not wait between plans
    overlaps = True

    def __init__(self, sharding: jax.sharding.Sharding, mask_words: int) -> None:
        super().__init__(sharding, mask_words)
        self._driver = Driver()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "jaxllm-mailbox")
        self._followed: collections.deque[_Plan] = collections.deque()  # in dispatch order

    def follow(self) -> concurrent.futures.Future:
        self._followed.append(self._opened)
        return self._thread.submit(self._run)

    def _answer(self, plan: _Plan, mask: np.ndarray, tag: int) -> None:
        """The masks first, then the flag that lets the device read them."""
        flag, masks, _ = plan.boxes
        self._driver.write(masks.unsafe_buffer_pointer(), mask)
        self._driver.write(flag.unsafe_buffer_pointer(), np.full(FLAG_WORDS, tag, np.int32))

    def _answer_first(self, plan: _Plan) -> None:
        """Writes `plan`'s first step's masks, from its grammars as the plans before left them."""
        self._answer(plan, plan.stepwise.first(), plan.base + 1)
        plan.answered = True

    def _run(self) -> dict[int, int]:
        """Answers the oldest plan followed: each step's tokens to its `StepwiseMasks`, its
        masks back; then the next plan's first masks, if it is followed already (else the
        next `_run` writes them). Returns the tokens its rows keep."""
        plan = self._followed.popleft()
        step = 0 if plan.answered else -1
        try:
            self._driver.use()
            if not plan.answered:
                self._wait_applied(plan)
                self._answer_first(plan)
            for step in range(plan.num_steps):
                tag = plan.base + 1 + step
                tokens = self._tokens(plan, tag)
                if step == 0:
                    self._wait_applied(plan)
                mask = plan.stepwise.after(step, tokens)
                if mask is not None:
                    self._answer(plan, mask, tag + 1)
            later = self._followed[0] if self._followed else None
            if later is not None and plan.generation == later.generation == self._generation:
                # NOTE: its first forward pass runs now; this plan is applied once `_run` returns
                self._answer_first(later)
        except BaseException:
            # NOTE: every later step let through (it samples unmasked), so the program ends
            every = np.full(plan.stepwise.num_rows * self._words, -1, np.int32)
            for later_step in range(step + 1, plan.num_steps):
                self._answer(plan, every, plan.base + 1 + later_step)
            raise
        return plan.stepwise.kept

    def _wait_applied(self, plan: _Plan) -> None:
        """Waits until the plan before `plan` is applied (`StepwiseMasks.ready`): until then the
        main thread reads the grammars, which `plan`'s steps advance."""
        while not plan.stepwise.ready.wait(0.1):
            if plan.generation != self._generation:
                raise RuntimeError("the engine was reset")

    def _tokens(self, plan: _Plan, tag: int) -> np.ndarray:
        """The tokens `plan`'s step published with `tag`, polled for."""
        outbox, num_rows = plan.boxes[2], plan.stepwise.num_rows
        words, address = np.zeros(outbox.shape[0], np.int32), outbox.unsafe_buffer_pointer()
        deadline = time.perf_counter() + HOST_TIMEOUT
        while True:
            self._driver.read(words, address)
            tags = words[:num_rows] >> TOKEN_BITS
            if (tags == tag).all():
                return words[:num_rows] & ((1 << TOKEN_BITS) - 1)
            if plan.generation != self._generation:
                raise RuntimeError("the engine was reset")
            if time.perf_counter() > deadline:  # later tags: the device gave up waiting
                raise TimeoutError(f"no tokens of tag {tag} in {HOST_TIMEOUT} s: {np.unique(tags)}")


class HostMailbox(Mailbox):
    """The tokens and masks through host callbacks (`io_callback`): each step's tokens go to
    `stepwise` as the program publishes them, and the next step's masks come back from there.
    The program's boxes go unused."""

    def __init__(self, sharding: jax.sharding.Sharding, mask_words: int) -> None:
        super().__init__(sharding, mask_words)
        self._masks: dict[int, np.ndarray] = {}  # by step tag: masks not yet read
        self._running: dict[int, _Plan] = {}  # by base tag, until their last step

    def publish(self, tokens: jax.Array, tag: jax.Array, outbox: jax.Array) -> jax.Array:
        result = jax.ShapeDtypeStruct(tokens.shape, jnp.int32)
        return io_callback(self._published, result, tokens, tag[0])

    def wait(self, tag: jax.Array, after: jax.Array, flag: jax.Array, masks: jax.Array):
        result = jax.ShapeDtypeStruct(masks.shape, jnp.int32)
        return io_callback(self._mask, result, tag[0], after[0, 0])

    def open(self, first_mask: np.ndarray, num_steps: int, stepwise) -> tuple:
        mailbox = super().open(first_mask, num_steps, stepwise)
        self._running[self._opened.base] = self._opened
        self._masks[self._opened.base + 1] = np.ascontiguousarray(first_mask).reshape(-1)
        return mailbox

    def reset(self) -> None:
        super().reset()
        self._masks.clear()
        self._running.clear()

    def _mask(self, tag, after) -> np.ndarray:
        del after  # orders the call after the step's forward pass
        return self._masks.pop(int(tag))

    def _published(self, tokens: np.ndarray, tag) -> np.ndarray:
        base = (int(tag) - 1) // STEP_TAGS * STEP_TAGS
        step, plan = int(tag) - 1 - base, self._running[base]
        try:
            mask = plan.stepwise.after(step, np.asarray(tokens))
        except BaseException as error:
            del self._running[base]
            plan.kept.set_exception(error)
            raise
        if mask is not None:
            self._masks[int(tag) + 1] = mask.reshape(-1).copy()
        else:  # NOTE: kept until here, as the program may run after `follow` returns
            del self._running[base]
            plan.kept.set_result(plan.stepwise.kept)
        return np.asarray(tokens)
