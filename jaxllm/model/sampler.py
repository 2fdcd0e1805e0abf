"""Token sampling on the device: greedy, temperature, top-k, top-p and min-p, mixed per row.

Filters apply in vLLM's order: temperature, min-p, top-k, top-p (on what min-p and top-k left).
Each keeps every token whose scaled logit reaches a per-row threshold, so ties with the boundary
are kept. Min-p compares each probability with the top one's; top-p's mass is that of the tokens
min-p and top-k keep.

The draw is Gumbel-max over the vocabulary with noise keyed by the row's (seed, step) alone: a
seeded request's tokens do not depend on the rest of the batch, its row or the batch size.

The host picks one of `SAMPLER_MODES` per step (`sampler_mode`), each compiled separately.
NOTE: not a `lax.cond` on device values: outside CUDA graphs XLA:GPU reads a conditional's
predicate on the host, which holds the dispatching thread until the queued model step is done.

Legend: S sampled rows, V vocab, B candidate blocks, W candidates (B times the block size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxllm.model.inputs import SamplingInputs

# Rows whose temperature is below this are greedy (vLLM's epsilon).
GREEDY_TEMPERATURE = 1e-5
# Top-k/top-p first look among candidates: the logits of the `NUM_CANDIDATE_BLOCKS` blocks (of
# `CANDIDATE_BLOCK_SIZE` tokens) with the largest maxima (see `_top_k_top_p_threshold`).
# NOTE: faster than `lax.top_k` or a full sort (docs/performance.md).
CANDIDATE_BLOCK_SIZE = 32
NUM_CANDIDATE_BLOCKS = 256
SAMPLER_MODES = ("greedy", "random", "top-k", "filtered")
# The variants that read the logits in one pass: they compile in a fraction of a second at any
# optimization, so the runner compiles them at XLA's default (`qwen3.DEFAULT_OPTIMIZATION`).
ONE_PASS_MODES = ("greedy", "random")
# The variants of greedy decoding and of SamplingParams' defaults (temperature 1, no filters),
# compiled with the ladder at start-up; the runner compiles the others for the whole ladder at
# their first use: a third of a cold start-up's compiling (docs/performance.md).
STARTUP_SAMPLER_MODES = ("greedy", "random")


def sampler_mode(
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    vocab_size: int,
) -> str:
    """The cheapest variant of `sample` that is exact for a batch's rows (host-side numpy).

    "greedy": every row is greedy. "random": no random row filters (one pass over the logits).
    "top-k": every random row that filters by top-k or top-p has 1 <= top_k <=
    `NUM_CANDIDATE_BLOCKS`, or rows filter by min-p alone; no full sort. "filtered": the
    general case, which may sort whole rows.
    """
    random_rows = np.asarray(temperature) >= GREEDY_TEMPERATURE
    if not random_rows.any():
        return "greedy"
    top_k = np.where(np.asarray(top_k) >= vocab_size, 0, top_k)
    filtering = random_rows & ((top_k > 0) | (np.asarray(top_p) < 1.0))
    if not filtering.any():
        # NOTE: min-p needs the probabilities, which "random" skips, but no sort.
        return "top-k" if (random_rows & (np.asarray(min_p) > 0)).any() else "random"
    small_k = (top_k >= 1) & (top_k <= NUM_CANDIDATE_BLOCKS)
    return "top-k" if small_k[filtering].all() else "filtered"


def sample(
    logits: jax.Array,
    inputs: SamplingInputs,
    candidate_block_size: int = CANDIDATE_BLOCK_SIZE,
    num_candidate_blocks: int = NUM_CANDIDATE_BLOCKS,
    *,
    mode: str = "filtered",
    fused_argmax: bool = True,
) -> jax.Array:
    """Samples one token per row: [S] int32 token ids; jittable (all arguments but the first two
    are static).

    Args:
        logits: [S, V] float32.
        inputs: the rows' settings, each field [S].
        candidate_block_size, num_candidate_blocks: the top-k/top-p candidates (tests shrink
            them to reach the full-sort path; results never depend on them).
        mode: one of `SAMPLER_MODES`; "filtered" is exact for any rows, the others only for
            the rows `sampler_mode` gives them for.
        fused_argmax: how the draw finds the largest noisy logit (`noisy_argmax`).
    """
    if mode not in SAMPLER_MODES:
        raise ValueError(f"unknown sampler mode {mode!r}; known: {', '.join(SAMPLER_MODES)}")
    logits = logits.astype(jnp.float32)
    if mode == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_greedy = inputs.temperature < GREEDY_TEMPERATURE
    noise = _gumbel_noise(inputs.seeds, inputs.seed_high, inputs.steps, logits.shape[-1])  # [S, V]
    if mode == "random":
        # NOTE: greedy rows (scaled by 1) get no noise, so their argmax is the greedy token.
        scaled = logits / jnp.where(is_greedy, 1.0, inputs.temperature)[:, None]
        noise = jnp.where(is_greedy[:, None], 0.0, noise)
        return noisy_argmax(scaled + noise, fused_argmax)
    kept = processed_logits(
        logits, inputs, candidate_block_size, num_candidate_blocks, fallback=mode == "filtered"
    )
    sampled = noisy_argmax(kept + noise, fused_argmax)
    return jnp.where(is_greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)


def noisy_argmax(noisy: jax.Array, fused: bool = True) -> jax.Array:
    """[S] int32 `jnp.argmax` of [S, V] noisy logits (the first largest; a NaN counts as largest).

    `fused`: one argmax, into which XLA:GPU fuses the noise (one pass over the logits). Else the
    largest value, then the first index holding it: XLA:CPU runs a fused argmax one element at a
    time: 16 rows of 151,936 tokens drawn in 43 ms, this way in 11 (docs/performance.md).
    """
    if fused:
        return jnp.argmax(noisy, axis=-1).astype(jnp.int32)
    largest = jnp.max(noisy, axis=-1, keepdims=True)
    return jnp.argmax((noisy == largest) | jnp.isnan(noisy), axis=-1).astype(jnp.int32)


def processed_logits(
    logits: jax.Array,
    inputs: SamplingInputs,
    block_size: int = CANDIDATE_BLOCK_SIZE,
    num_blocks: int = NUM_CANDIDATE_BLOCKS,
    *,
    fallback: bool = True,
) -> jax.Array:
    """[S, V] float32 the logits each row samples from: divided by its temperature, with the
    tokens its top-k, top-p and min-p remove at -inf (vLLM's "processed" logits); a greedy
    row's as they are. `fallback=False`: exact only for the rows `sampler_mode` gives "top-k"."""
    logits = logits.astype(jnp.float32)
    is_greedy = inputs.temperature < GREEDY_TEMPERATURE
    scaled = logits / jnp.where(is_greedy, 1.0, inputs.temperature)[:, None]  # [S, V]
    vocab_size = scaled.shape[-1]
    row_max = jnp.max(scaled, axis=-1)  # [S]
    ratio = jnp.exp(scaled - row_max[:, None])  # [S, V] probability over the top one's
    # NOTE: greedy rows switch their filters off, so they never cost a sort.
    top_k = jnp.where(is_greedy | (inputs.top_k >= vocab_size), 0, inputs.top_k)
    top_k = jnp.maximum(top_k, 0)
    top_p = jnp.where(is_greedy, 1.0, inputs.top_p)
    filtered = (top_k > 0) | (top_p < 1.0)
    min_p = inputs.min_p
    threshold = _top_k_top_p_threshold(
        scaled, ratio, row_max, top_k, top_p, min_p, filtered, block_size, num_blocks, fallback
    )
    keep = (scaled >= threshold[:, None]) & (ratio >= min_p[:, None])
    # NOTE: the top token always passes min-p (its ratio is 1, but recomputed in another fusion
    # it may round below a min_p near 1); without it a row could keep nothing.
    greedy_tokens = jnp.argmax(logits, axis=-1)  # [S]
    keep = keep | (jnp.arange(vocab_size)[None, :] == greedy_tokens[:, None])
    # A greedy row's scaled logits are its logits (divided by 1), all kept.
    return jnp.where(keep | is_greedy[:, None], scaled, -jnp.inf)


def _mix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 that mixes every bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EB_CA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2_AE35)
    return x ^ (x >> 16)


def _gumbel_noise(
    seeds: jax.Array, seed_high: jax.Array, steps: jax.Array, vocab_size: int
) -> jax.Array:
    """[S, V] Gumbel noise; row s is a function of (seeds[s], seed_high[s], steps[s]) only.

    Two 32-bit row keys, a bijection of the 64-bit seed at each step, key the hash of each token
    index: seeds that differ in any bit draw different streams. A seed below 2**32 has both keys
    equal (`_mix32(0)` is 0).

    NOTE: a hash of the token index keyed by the row's seed and step is one fused elementwise
    pass, where `jax.random` with vmapped threefry keys costs a millisecond per step at S=512.
    """
    golden = jnp.uint32(0x9E37_79B9)
    row_key = _mix32(seeds.astype(jnp.uint32) ^ _mix32(steps.astype(jnp.uint32) * golden + 1))
    high_key = row_key ^ _mix32(seed_high.astype(jnp.uint32))  # [S]
    index = jnp.arange(vocab_size, dtype=jnp.uint32)
    bits = _mix32(_mix32(index[None, :] * golden + row_key[:, None]) ^ high_key[:, None])
    return -jnp.log(-jnp.log(uniform_open(bits)))


def uniform_open(bits: jax.Array) -> jax.Array:
    """uint32 random bits as float32 uniform in the open interval (0, 1), so the Gumbel noise
    is finite: a banned token's -inf plus +inf noise would be NaN, which argmax picks."""
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    # NOTE: the top value, 1 - 2**-25, rounds to 1.0 in float32.
    return jnp.minimum(uniform, jnp.float32(1.0 - 2.0**-24))


def _top_k_top_p_threshold(
    scaled,
    ratio,
    row_max,
    top_k,
    top_p,
    min_p,
    filtered,
    block_size: int,
    num_blocks: int,
    fallback: bool = True,
) -> jax.Array:
    """[S] smallest scaled logit that top-k and top-p keep, of the tokens min-p keeps (-inf
    where a row filters nothing); `scaled` and `ratio` are [S, V], the other arrays [S].

    A row's threshold comes from its candidates when that is exact: always for 1 <= top_k <=
    `num_blocks` (the k largest logits lie in the k blocks with the largest maxima), else when
    the kept set ends strictly above the candidates' bound. Other rows sort their whole row,
    under a `lax.cond` that `fallback=False` ("top-k") leaves out. The choice is per row.
    """
    ratio = jnp.where(ratio >= min_p[:, None], ratio, 0.0)  # what min-p removes has no mass
    full_mass = jnp.sum(ratio, axis=-1)  # [S]
    candidates, bound = _candidates(scaled, block_size, num_blocks)
    k_threshold = _kth_largest(candidates, top_k)
    # NOTE: the top-k mass over the whole row: tokens tied with the k-th largest count even
    # when they lie outside the candidates.
    k_mass = jnp.sum(jnp.where(scaled >= k_threshold[:, None], ratio, 0.0), axis=-1)
    threshold, _ = _threshold_from_sorted(
        candidates, row_max, full_mass, top_k, top_p, min_p, k_mass
    )
    if not fallback:
        return jnp.where(filtered, threshold, -jnp.inf)
    # NOTE: otherwise a threshold above the bound means that every token kept is a candidate and
    # the top-k mass is complete: the candidates gave the exact answer.
    small_k = (top_k >= 1) & (top_k <= num_blocks)
    exact = ~filtered | small_k | ((threshold > bound) & ((top_k == 0) | (k_threshold > bound)))

    def sort_rows() -> jax.Array:
        descending = jnp.sort(scaled, axis=-1, descending=True)  # [S, V]
        full, _ = _threshold_from_sorted(descending, row_max, full_mass, top_k, top_p, min_p)
        return jnp.where(exact, threshold, full)

    threshold = jax.lax.cond(jnp.all(exact), lambda: threshold, sort_rows)
    return jnp.where(filtered, threshold, -jnp.inf)


def _kth_largest(descending: jax.Array, top_k: jax.Array) -> jax.Array:
    """[S] each row's top_k-th largest value of [S, W] descending (-inf where top_k is 0)."""
    width = descending.shape[-1]
    k_index = jnp.where(top_k > 0, jnp.minimum(top_k, width), width) - 1
    k_threshold = jnp.take_along_axis(descending, k_index[:, None], axis=-1)[:, 0]
    return jnp.where(top_k > 0, k_threshold, -jnp.inf)


def _candidates(scaled: jax.Array, block_size: int, num_blocks: int) -> tuple[jax.Array, jax.Array]:
    """[S, W] each row's candidate logits (its blocks with the largest maxima), descending, and
    [S] their bound: every logit above it is a candidate."""
    num_rows, vocab_size = scaled.shape
    total_blocks = -(-vocab_size // block_size)
    if num_blocks >= total_blocks:
        descending = jnp.sort(scaled, axis=-1, descending=True)
        return descending, jnp.full((num_rows,), -jnp.inf, scaled.dtype)
    padding = total_blocks * block_size - vocab_size
    blocks = jnp.pad(scaled, ((0, 0), (0, padding)), constant_values=-jnp.inf)
    blocks = blocks.reshape(num_rows, total_blocks, block_size)
    block_max, block_ids = jax.lax.top_k(jnp.max(blocks, axis=-1), num_blocks)  # [S, B]
    candidates = jnp.take_along_axis(blocks, block_ids[:, :, None], axis=1)  # [S, B, block]
    descending = jnp.sort(candidates.reshape(num_rows, -1), axis=-1, descending=True)  # [S, W]
    return descending, block_max[:, -1]


def _threshold_from_sorted(
    descending, row_max, full_mass, top_k, top_p, min_p, k_mass: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """[S] the combined top-k/top-p threshold and [S] the top-k one (-inf where top-k is off),
    from the W largest scaled logits of each row, [S, W] descending; top-p over the tokens
    min-p keeps. Exact when both end strictly inside the W values (always when W == V).

    `k_mass` is the mass of the tokens top-k and min-p keep (in units of the top token's
    probability) where the caller knows it; else it is summed over the W values.
    """
    k_threshold = _kth_largest(descending, top_k)
    ratio = jnp.exp(descending - row_max[:, None])  # [S, W]
    in_top_k = (descending >= k_threshold[:, None]) & (ratio >= min_p[:, None])
    weights = jnp.where(in_top_k, ratio, 0.0)
    if k_mass is None:
        k_mass = jnp.sum(weights, axis=-1)
    mass = jnp.where(top_k > 0, k_mass, full_mass)  # [S]
    cumulative = jnp.cumsum(weights, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], -1)
    # Keep the prefix up to and including the first token at which the mass reaches top_p.
    keep = in_top_k & (mass_before < (top_p * mass)[:, None])
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    p_threshold = jnp.take_along_axis(descending, (num_kept - 1)[:, None], axis=-1)[:, 0]
    threshold = jnp.where(top_p < 1.0, jnp.maximum(p_threshold, k_threshold), k_threshold)
    return threshold, k_threshold


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int) -> jax.Array:
    """The log-softmax of raw logits [S, V] at the sampled tokens [S], as one float32 array
    [S, 2 + 2 * num_top]: per row the token's logprob, its rank (the tokens at least as likely,
    itself included, as vLLM counts ties), the `num_top` most likely token ids, then their
    logprobs. NOTE: one array, one transfer to the host; ids and ranks below 2**24 are exact in
    float32."""
    logits = logits.astype(jnp.float32)
    log_total = jax.nn.logsumexp(logits, axis=-1, keepdims=True)  # [S, 1]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)  # [S, 1]
    rank = jnp.sum(logits >= chosen, axis=-1, keepdims=True)
    top_logits, top_ids = top_k(logits, num_top)
    parts = (chosen - log_total, rank, top_ids, top_logits - log_total)
    return jnp.concatenate([part.astype(jnp.float32) for part in parts], axis=-1)


def top_k(
    values: jax.Array, k: int, block_size: int = CANDIDATE_BLOCK_SIZE
) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` of [S, V] rows, from the k blocks with the largest maxima, which hold the k
    largest values; ties go to the lower index, as in `lax.top_k`. NOTE: `lax.top_k` over a
    151,936-token row sorts it on a GPU."""
    num_rows, vocab_size = values.shape
    num_blocks = -(-vocab_size // block_size)
    if k >= num_blocks:
        return lax.top_k(values, k)
    padding = num_blocks * block_size - vocab_size
    blocks = jnp.pad(values, ((0, 0), (0, padding)), constant_values=-jnp.inf)
    blocks = blocks.reshape(num_rows, num_blocks, block_size)
    _, block_ids = lax.top_k(jnp.max(blocks, axis=-1), k)  # [S, k]
    block_ids = jnp.sort(block_ids, axis=-1)  # so the candidates keep the vocabulary's order
    candidates = jnp.take_along_axis(blocks, block_ids[:, :, None], axis=1)  # [S, k, block]
    ids = block_ids[:, :, None] * block_size + jnp.arange(block_size)
    top, where = lax.top_k(candidates.reshape(num_rows, -1), k)
    return top, jnp.take_along_axis(ids.reshape(num_rows, -1), where, axis=-1)
