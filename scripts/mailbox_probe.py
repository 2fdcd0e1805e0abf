"""Can a program of several steps hand each step's token to the host and wait, on the device,
for what the host computes from it (a token mask), while the next step's work runs?

    python scripts/mailbox_probe.py [--steps 8] [--work-ms 1.0] [--loop]

One program runs `--steps` steps, each: `work` (a chain of matmuls of about `--work-ms`), then
`wait_for_mask` (a Pallas kernel that spins on a flag in a device buffer, the mailbox, until the
host has written step j's mask there), then a "sample" (a token from the work's output and the
mask), then `publish` (a Pallas kernel that stores the token, with its step, in another device
buffer, the outbox) before the next step's work, which reads the token. A host thread polls the
outbox through its own CUDA stream (the driver's API through ctypes, on the device pointers of
the two buffers), and for each published token writes the next step's mask (a function of the
token) and then its flag into the mailbox; XLA's stream never waits for the host, only the
spinning kernel does.

It checks that every step's mask is the one computed from the step before's token (a real
handoff, not stale data), and prints the program's time a step with the handoff and without it
(the mask computed on the device from the same token), the spin iterations of each step's wait
(how long the device waited for the host) and the host's poll-to-write latency. With `--loop`
the steps run in a `fori_loop` (a WHILE command buffer where XLA allows), else unrolled.
A GPU probe: it needs libcuda and the Triton backend of Pallas.
"""

from __future__ import annotations

import argparse
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.handoff import Driver
from jaxllm.model.attention import LOOP_COMMAND_BUFFERS

WORDS = 8_192  # more than a token bitmask of 151,936 tokens (4,748 words): a power of two
HEADER = 8  # the mailbox's flag, repeated (Triton blocks are powers of two)
SPIN_LIMIT = 1 << 22  # a wait gives up after this many polls (seconds; the host died): -1
VOCAB = 151_936
INTERPRET = False  # True runs the kernels in Python (a CPU check of their logic)


def _publish_kernel(token_ref, step_ref, outbox_ref, out_ref):
    # One int32 carries both, so the host never reads a step with another step's token.
    token, step = token_ref[...], step_ref[...]
    word = (step + 1) * (1 << 18) + token
    outbox_ref[...] = word  # NOTE: an input buffer written in place: the host reads it
    out_ref[...] = token


def publish(token: jax.Array, step: jax.Array, outbox: jax.Array) -> jax.Array:
    """Stores `token` and `step` in `outbox`; returns the token (later steps read this one)."""
    return pl.pallas_call(
        _publish_kernel,
        out_shape=jax.ShapeDtypeStruct((HEADER,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=1),
        interpret=INTERPRET,
    )(token, step, outbox)


def _wait_kernel(step_ref, after_ref, mailbox_ref, mask_ref, polls_ref):
    del after_ref  # only orders the wait after the step's work
    want = jnp.max(step_ref[...]) + 1

    def waiting(state):
        flag, polls = state
        return (flag < want) & (polls < SPIN_LIMIT)

    def poll(state):
        _, polls = state
        header = plgpu.load(mailbox_ref.at[pl.ds(0, HEADER)], volatile=True)
        return jnp.min(header), polls + 1

    flag, polls = lax.while_loop(waiting, poll, (jnp.int32(0), jnp.int32(0)))
    mask = plgpu.load(mailbox_ref.at[pl.ds(HEADER, WORDS)], volatile=True)
    mask_ref[...] = jnp.where(flag >= want, mask, -1)
    polls_ref[...] = jnp.full((HEADER,), polls, jnp.int32)


def wait_for_mask(step, after, mailbox):
    """Spins until the mailbox's flag reaches step + 1; returns its mask and the polls taken."""
    return pl.pallas_call(
        _wait_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((WORDS,), jnp.int32),
            jax.ShapeDtypeStruct((HEADER,), jnp.int32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=4),
        interpret=INTERPRET,
    )(step, after, mailbox)


def mask_for(token: int | jax.Array, step: int | jax.Array):
    """The mask step `step` gets from the token before it (the same on the host and device)."""
    return (token * 7 + step) % 1_000_003


def work(y: jax.Array, w: jax.Array, repeats: int) -> jax.Array:
    for _ in range(repeats):
        y = jnp.tanh(y @ w)
    return y


def build(steps: int, repeats: int, handoff: bool, loop: bool):
    def step_fn(j, state):
        y, w, token, mailbox, outbox, tokens, masks, polls = state
        y = work(y + (token[0] % 2).astype(y.dtype), w, repeats)
        step = jnp.full((HEADER,), j, jnp.int32)
        if handoff:
            mask, spun = wait_for_mask(step, y[0, :HEADER].astype(jnp.float32), mailbox)
            mask_word = mask[0]
        else:
            mask_word, spun = mask_for(token[0], j), jnp.zeros((HEADER,), jnp.int32)
        sampled = (jnp.abs(y[0, :16]).sum().astype(jnp.float32) * 1e3).astype(jnp.int32)
        sampled = (sampled + mask_word) % VOCAB
        token = jnp.full((HEADER,), sampled, jnp.int32)
        if handoff:
            token = publish(token, step, outbox)
        tokens = tokens.at[j].set(token[0])
        masks = masks.at[j].set(mask_word)
        polls = polls.at[j].set(spun[0])
        return y, w, token, mailbox, outbox, tokens, masks, polls

    def program(y, w, mailbox, outbox):
        token = jnp.zeros((HEADER,), jnp.int32)
        zeros = jnp.zeros((steps,), jnp.int32)
        state = (y, w, token, mailbox, outbox, zeros, zeros, zeros)
        if loop:
            state = lax.fori_loop(0, steps, step_fn, state)
        else:
            for j in range(steps):
                state = step_fn(j, state)
        return state[0], state[5], state[6], state[7]

    return jax.jit(program)


class Host:
    """The host's side: answers each published token with the next step's mask (the words,
    then the flag), on a thread of its own, through the engine's `handoff.Driver`."""

    def __init__(self, driver: Driver, mailbox_ptr: int, outbox_ptr: int) -> None:
        self.driver, self.mailbox_ptr, self.outbox_ptr = driver, mailbox_ptr, outbox_ptr
        self.outbox = np.zeros(HEADER, np.int32)
        self.words = np.zeros(WORDS, np.int32)
        self.flag = np.zeros(HEADER, np.int32)
        self.latencies: list[float] = []

    def start(self, steps: int) -> threading.Thread:
        """Writes step 0's mask (from token 0) and starts answering steps 1 .. steps - 1."""
        self._write_mask(mask_for(0, 0), 1)
        thread = threading.Thread(target=self._answer, args=(steps,))
        thread.start()
        return thread

    def reset(self) -> None:
        self.flag[:] = 0
        self.driver.write(self.mailbox_ptr, self.flag)

    def _write_mask(self, mask: int, flag: int) -> None:
        self.words[:] = mask
        self.driver.write(self.mailbox_ptr + HEADER * 4, self.words)
        self.flag[:] = flag
        self.driver.write(self.mailbox_ptr, self.flag)

    def _answer(self, steps: int) -> None:
        self.driver.use()
        for j in range(1, steps):
            deadline = time.perf_counter() + 10
            while True:
                self.driver.read(self.outbox, self.outbox_ptr)
                word = int(self.outbox[0])
                if word >> 18 == j:  # step j - 1 published
                    break
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"step {j - 1} never published (outbox {word})")
            seen = time.perf_counter()
            self._write_mask(mask_for(word & ((1 << 18) - 1), j), j + 1)
            self.latencies.append(time.perf_counter() - seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--work-ms", type=float, default=1.0)
    parser.add_argument("--loop", action="store_true")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--while-command-buffer",
        action="store_true",
        help="with --loop: the loop inside the CUDA graph (WHILE commands), as the engine's",
    )
    args = parser.parse_args()
    options = {}
    if args.while_command_buffer:
        options["xla_gpu_enable_command_buffer"] = LOOP_COMMAND_BUFFERS
    driver = Driver()
    rows, size = 256, 4096
    w = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16) / np.sqrt(size)
    y = jax.random.normal(jax.random.key(1), (rows, size), jnp.bfloat16)
    mailbox = jnp.zeros((HEADER + WORDS,), jnp.int32)
    outbox = jnp.zeros((HEADER,), jnp.int32)
    inputs = (y, w, mailbox, outbox)
    # The work: matmuls of rows x size x size, as many as take about --work-ms a step.
    plain = build(args.steps, 1, handoff=False, loop=args.loop).lower(*inputs)
    plain = plain.compile(options)
    jax.block_until_ready(plain(*inputs))
    start = time.perf_counter()
    jax.block_until_ready(plain(*inputs))
    per_repeat = (time.perf_counter() - start) / args.steps
    repeats = max(1, round(args.work_ms * 1e-3 / per_repeat))
    programs = {
        name: build(args.steps, repeats, handoff=handoff, loop=args.loop)
        .lower(*inputs)
        .compile(options)
        for name, handoff in (("on the device", False), ("handed to the host", True))
    }
    host = Host(driver, mailbox.unsafe_buffer_pointer(), outbox.unsafe_buffer_pointer())
    print(f"{args.steps} steps of {repeats} matmuls ({rows} x {size} x {size}), {vars(args)}")
    results = {}
    for name, program in programs.items():
        handoff = name == "handed to the host"
        times, polls, ok = [], [], True
        for _ in range(args.runs + 1):
            thread = host.start(args.steps) if handoff else None
            start = time.perf_counter()
            _, tokens, masks, spun = jax.block_until_ready(program(*inputs))
            times.append(time.perf_counter() - start)
            if thread is not None:
                thread.join()
                host.reset()
            tokens, masks = np.asarray(tokens), np.asarray(masks)
            expected = [mask_for(0, 0)] + [
                mask_for(int(tokens[j - 1]), j) for j in range(1, args.steps)
            ]
            ok &= bool(np.array_equal(masks, expected))
            polls.append(np.asarray(spun))
        results[name] = min(times[1:]) / args.steps
        print(f"{name}: {results[name] * 1e3:.3f} ms a step (best of {args.runs}), masks ok: {ok}")
        if handoff:
            spun, latencies = np.concatenate(polls[1:]), np.array(host.latencies) * 1e6
            print(f"  the device's polls a step: median {np.median(spun):.0f}, max {spun.max()}")
            print(
                f"  the host, token seen to flag written: median {np.median(latencies):.0f} us,"
                f" max {latencies.max():.0f} us"
            )
    ratio = results["handed to the host"] / results["on the device"]
    print(f"handed to the host / on the device: {ratio:.3f}")


if __name__ == "__main__":
    main()
