"""The device sampler against exact distributions computed in numpy, and its key derivation.

Distribution tests sample one hand-chosen logit row once per seed (N seeds, step 0) and compare
the empirical distribution with the exact one: the total-variation distance must stay within the
99.9% quantile of what a correct multinomial sampler of N draws shows, and tokens outside the
allowed set must never appear.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.sampling import assert_matches, exact_distribution

from jaxllm.model import sampler as sampler_module
from jaxllm.model.inputs import SamplingInputs, fold_seed
from jaxllm.model.sampler import SAMPLER_MODES, sample, sampler_mode, token_logprobs
from jaxllm.sampling_params import SamplingParams

NUM_DRAWS = 4096
_sample = jax.jit(sample)

# Probabilities of the 32-token test row at temperature 1, in a shuffled token order. Sorted:
# 0.40, 0.25, 0.15, 0.10, then 28 tokens sharing 0.10 unevenly.
_HEAD = [0.40, 0.25, 0.15, 0.10]
_TAIL = np.linspace(1.0, 2.0, 28) / np.linspace(1.0, 2.0, 28).sum() * 0.10
_ORDER = np.random.default_rng(7).permutation(32)
PROBS = np.empty(32)
PROBS[_ORDER] = np.concatenate([_HEAD, _TAIL])
LOGITS = np.log(PROBS).astype(np.float32) + 3.0  # an offset changes nothing


def draw(logits, num_draws=NUM_DRAWS, steps=0, **settings):
    """Samples `logits` once per seed 0..num_draws-1 (rows of one batch)."""
    params = [SamplingParams(seed=seed, **settings) for seed in range(num_draws)]
    inputs = SamplingInputs.from_params(params, [steps] * num_draws)
    batch = np.broadcast_to(logits, (num_draws, len(logits)))
    return np.asarray(_sample(jnp.asarray(batch), inputs))


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature(temperature):
    expected = exact_distribution(LOGITS, temperature)
    assert_matches(draw(LOGITS, temperature=temperature), expected)


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_top_k(top_k):
    expected = exact_distribution(LOGITS, top_k=top_k)
    assert np.count_nonzero(expected) == top_k
    assert_matches(draw(LOGITS, top_k=top_k), expected)


@pytest.mark.parametrize(
    ("top_p", "num_kept"),
    [
        (0.3, 1),  # the top token alone reaches 0.3
        (0.6, 2),  # 0.40 < 0.6 <= 0.65: the boundary token (0.25) is kept
        (0.66, 3),  # 0.65 < 0.66: a third token is needed
        (0.95, 16),  # into the tail: 0.9475 < 0.95 <= 0.9513
    ],
)
def test_top_p_keeps_the_boundary_token(top_p, num_kept):
    expected = exact_distribution(LOGITS, top_p=top_p)
    assert np.count_nonzero(expected) == num_kept
    assert_matches(draw(LOGITS, top_p=top_p), expected)


def test_top_p_applies_to_the_top_k_distribution():
    # Top-3 renormalized is 0.5, 0.3125, 0.1875: top_p=0.7 keeps 2 tokens (before top-k: 3).
    expected = exact_distribution(LOGITS, top_k=3, top_p=0.7)
    assert np.count_nonzero(expected) == 2
    assert_matches(draw(LOGITS, top_k=3, top_p=0.7), expected)


def test_top_p_applies_to_what_min_p_left():
    # Min-p 0.3 keeps 0.40, 0.25 and 0.15 (>= 0.12), renormalized 0.5, 0.3125, 0.1875: top_p
    # 0.7 keeps 2 tokens. Top-p over the whole row (0.40, 0.65, 0.80) would keep 3.
    expected = exact_distribution(LOGITS, top_p=0.7, min_p=0.3)
    assert np.count_nonzero(expected) == 2
    assert_matches(draw(LOGITS, top_p=0.7, min_p=0.3), expected)


@pytest.mark.parametrize(("min_p", "temperature"), [(0.3, 1.0), (0.3, 1.5), (0.05, 0.8)])
def test_min_p(min_p, temperature):
    expected = exact_distribution(LOGITS, temperature, min_p=min_p)
    assert 1 < np.count_nonzero(expected) < 32
    assert_matches(draw(LOGITS, temperature=temperature, min_p=min_p), expected)


def test_greedy_is_argmax():
    logits = np.random.default_rng(1).normal(size=(64, 32)).astype(np.float32)
    rng = np.random.default_rng(2)
    params = [
        SamplingParams(
            temperature=0.0,
            top_k=int(rng.integers(0, 5)),
            top_p=float(rng.uniform(0.1, 1.0)),
            min_p=float(rng.uniform(0.0, 1.0)),
            seed=row,
        )
        for row in range(64)
    ]
    tokens = _sample(jnp.asarray(logits), SamplingInputs.from_params(params, range(64)))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_mixed_settings_in_one_batch():
    settings = [
        {"temperature": 0.0},
        {"temperature": 1.7},
        {"top_k": 3},
        {"top_p": 0.6},
        {"top_k": 3, "top_p": 0.7},
        {"min_p": 0.3, "temperature": 1.5},
    ]
    rows = [(group, seed) for seed in range(NUM_DRAWS // 4) for group in range(len(settings))]
    params = [SamplingParams(seed=seed, **settings[group]) for group, seed in rows]
    batch = np.broadcast_to(LOGITS, (len(rows), 32))
    tokens = np.asarray(
        _sample(jnp.asarray(batch), SamplingInputs.from_params(params, [0] * len(rows)))
    )
    groups = np.array([group for group, _ in rows])
    for group, setting in enumerate(settings):
        assert_matches(tokens[groups == group], exact_distribution(LOGITS, **setting))


def test_seeded_row_is_independent_of_the_batch():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, 32)).astype(np.float32)
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    for step in range(20):
        alone = _sample(jnp.asarray(logits[5:6]), SamplingInputs.from_params([mine], [step]))
        others = [SamplingParams(temperature=0.8, top_k=4, seed=s) for s in range(7)]
        params = [*others[:5], mine, *others[5:]]
        batch = _sample(jnp.asarray(logits), SamplingInputs.from_params(params, [step] * 8))
        assert int(alone[0]) == int(batch[5])


def test_steps_give_different_streams():
    logits = np.zeros((1, 32), np.float32)
    params = SamplingParams(seed=99)

    def stream(step_list, seed_params=params):
        batch = np.broadcast_to(logits, (len(step_list), 32))
        inputs = SamplingInputs.from_params([seed_params] * len(step_list), step_list)
        return np.asarray(_sample(jnp.asarray(batch), inputs))

    tokens = stream(list(range(256)))
    assert len(set(tokens.tolist())) > 20  # uniform over 32 tokens: about 31 distinct
    np.testing.assert_array_equal(tokens, stream(list(range(256))))  # reproducible
    np.testing.assert_array_equal(tokens[10:20], stream(list(range(10, 20)))[:10])
    other_seed = stream(list(range(256)), SamplingParams(seed=100))
    assert np.mean(tokens == other_seed) < 0.2


@pytest.mark.parametrize(
    ("seed", "other"),
    [
        (5, 5 + 2**32),  # the high words alone differ
        (1, 2**32),  # the same fold (low ^ high word)
        (2**32 + 7, 2**33 + 4),  # the same fold
        (2**64 - 1, 2**63 - 1),  # the top bit alone differs
    ],
)
def test_every_bit_of_a_seed_selects_its_stream(seed, other):
    logits = np.zeros((1, 32), np.float32)

    def stream(seed: int) -> np.ndarray:
        inputs = SamplingInputs.from_params([SamplingParams(seed=seed)] * 256, range(256))
        return np.asarray(_sample(jnp.asarray(np.broadcast_to(logits, (256, 32))), inputs))

    tokens = stream(seed)
    np.testing.assert_array_equal(tokens, stream(seed))
    assert np.mean(tokens == stream(other)) < 0.2  # uniform over 32 tokens: about 1/32


RECORDED_SEED_99 = [30, 16, 3, 24, 24, 2, 12, 24]


def test_a_seed_below_2_to_32_keys_the_stream_it_always_did():
    """The high word of such a seed is 0, which leaves its key unchanged: the first tokens of
    seed 99 over steps 0..7 (uniform over 32 tokens) are those recorded before high words."""
    inputs = SamplingInputs.from_params([SamplingParams(seed=99)] * 8, range(8))
    tokens = _sample(jnp.zeros((8, 32), jnp.float32), inputs)
    assert np.asarray(tokens).tolist() == RECORDED_SEED_99


def test_candidate_and_full_sort_paths_agree():
    """Rows that fit the top-k/top-p candidates and rows that need a full sort agree exactly."""
    rng = np.random.default_rng(4)
    vocab_size = 1000
    peaked = rng.normal(size=vocab_size).astype(np.float32) * 4.0
    flat = rng.normal(size=vocab_size).astype(np.float32) * 0.3
    settings = [{"top_k": 20}, {"top_p": 0.8}, {"top_k": 50, "top_p": 0.9}, {"min_p": 0.1}]
    rows = [
        (logit_row, setting, seed)
        for logit_row in (peaked, flat)
        for setting in settings
        for seed in range(16)
    ]
    params = [SamplingParams(seed=seed, **setting) for _, setting, seed in rows]
    logits = jnp.asarray(np.stack([logit_row for logit_row, _, _ in rows]))
    inputs = SamplingInputs.from_params(params, [3] * len(rows))
    # With 64 blocks of 4 tokens, every peaked row fits the candidates; flat top_p=0.8 does not.
    fits = uses_candidates(logits, inputs, 4, 64)
    half = len(rows) // 2
    assert fits[:half].all() and not fits[half:].all()
    filtered = (inputs.top_k > 0) | (inputs.top_p < 1)
    assert not uses_candidates(logits, inputs, 4, 2)[filtered].any()
    sample_with = jax.jit(sample, static_argnums=(2, 3))
    # Whole rows as candidates; a mix of both paths; the full sort for every row.
    results = [
        np.asarray(sample_with(logits, inputs, block_size, num_blocks))
        for block_size, num_blocks in [(32, 32), (4, 64), (4, 2)]
    ]
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])
    # The peaked rows alone (the full sort is skipped) give the same tokens as in the mix.
    alone = sample_with(logits[:half], jax.tree.map(lambda a: a[:half], inputs), 4, 64)
    np.testing.assert_array_equal(alone, results[0][:half])


def uses_candidates(logits, inputs, block_size, num_blocks):
    """Which rows the candidate path answers exactly (the others need the full sort)."""
    scaled = logits / inputs.temperature[:, None]
    row_max = scaled.max(-1)
    full_mass = jnp.exp(scaled - row_max[:, None]).sum(-1)
    candidates, bound = sampler_module._candidates(scaled, block_size, num_blocks)
    threshold, k_threshold = sampler_module._threshold_from_sorted(
        candidates,
        row_max,
        full_mass,
        jnp.asarray(inputs.top_k),
        jnp.asarray(inputs.top_p),
        jnp.asarray(inputs.min_p),
    )
    filtered = (inputs.top_k > 0) | (inputs.top_p < 1)
    small_k = (inputs.top_k >= 1) & (inputs.top_k <= num_blocks)
    fits = small_k | ((threshold > bound) & ((inputs.top_k == 0) | (k_threshold > bound)))
    return np.asarray(fits) | ~filtered


def test_top_p_over_more_tokens_than_candidates():
    vocab_size = 1000
    logits = np.random.default_rng(5).normal(size=vocab_size).astype(np.float32) * 0.5
    expected = exact_distribution(logits, top_p=0.5)
    assert np.count_nonzero(expected) > 8 * 16  # more than the candidates: the full-sort path
    params = [SamplingParams(seed=seed, top_p=0.5) for seed in range(2048)]
    batch = jnp.asarray(np.broadcast_to(logits, (2048, vocab_size)))
    inputs = SamplingInputs.from_params(params, [0] * 2048)
    tokens = jax.jit(sample, static_argnums=(2, 3))(batch, inputs, 8, 16)
    assert_matches(np.asarray(tokens), expected)


def test_from_params_pads_with_greedy_rows():
    inputs = SamplingInputs.from_params([SamplingParams(seed=2**40 + 5, top_k=7)], [11], 4)
    np.testing.assert_array_equal(inputs.temperature, [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(inputs.top_k, [7, 0, 0, 0])
    np.testing.assert_array_equal(inputs.steps, [11, 0, 0, 0])
    assert inputs.seeds.dtype == inputs.seed_high.dtype == np.uint32
    assert (inputs.seeds[0], inputs.seed_high[0]) == (fold_seed(2**40 + 5), 2**8)
    np.testing.assert_array_equal(inputs.seed_high[1:], 0)
    assert fold_seed(2**40 + 5) != fold_seed(5)
    huge = SamplingInputs.from_params([SamplingParams(top_k=2**40)], [0], 1)
    assert huge.top_k.tolist() == [np.iinfo(np.int32).max]  # the whole vocabulary either way
    with pytest.raises(ValueError):
        SamplingInputs.from_params([SamplingParams()] * 3, [0, 0, 0], 2)


def test_the_host_picks_the_cheapest_exact_sampler():
    def mode(temperature, top_k=0, top_p=1.0, min_p=0.0, rows=3):
        settings = (temperature, top_k, top_p, min_p)
        return sampler_mode(*(np.full(rows, value) for value in settings), 1000)

    assert mode(0.0) == "greedy"
    assert mode(0.0, top_k=5, top_p=0.5) == "greedy"  # greedy rows ignore their filters
    assert mode(0.7) == "random"
    assert mode(0.7, top_k=1000) == "random"  # top_k >= vocab keeps every token
    assert mode(0.7, top_k=5) == "top-k"
    assert mode(0.7, top_k=20, top_p=0.95) == "top-k"  # Qwen3's recommended settings
    assert mode(0.7, top_k=300) == "filtered"  # beyond the 256 candidate blocks
    assert mode(0.7, top_p=0.9) == "filtered"
    assert mode(0.7, min_p=0.1) == "top-k"  # min-p alone needs no sort
    assert mode(0.7, top_k=20, min_p=0.1) == "top-k"
    assert mode(0.7, top_p=0.9, min_p=0.1) == "filtered"
    assert mode(0.0, min_p=0.1) == "greedy"
    temperature, no_min_p = np.array([0.0, 0.8, 0.8]), np.zeros(3)
    greedy_and_random = sampler_mode(
        temperature[:2], np.array([5, 0]), np.ones(2), np.array([0.5, 0.0]), 1000
    )
    assert greedy_and_random == "random"
    mixed = sampler_mode(
        temperature, np.array([0, 5, 0]), np.array([0.5, 1.0, 0.9]), no_min_p, 1000
    )
    assert mixed == "filtered"  # the last row filters by top-p alone


@pytest.mark.parametrize("mode", ["greedy", "random", "top-k"])
def test_each_mode_equals_the_general_sampler_on_its_rows(mode):
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(16, 300)).astype(np.float32) * 3)
    temperatures = [0.0, 0.8, 1e-4, 1.3]
    if mode == "greedy":
        params = [SamplingParams(temperature=0.0, top_k=7)] * 16
    elif mode == "random":  # random rows, greedy rows (which keep their min-p) among them
        params = [
            SamplingParams(temperature=temperatures[row % 4], min_p=0.5 * (row % 4 == 0), seed=row)
            for row in range(16)
        ]
    else:  # rows that filter by min-p alone (up to 1: only the top token), and greedy rows
        min_ps = [0.05, 1.0, 0.999, 0.0]
        params = [
            SamplingParams(temperature=temperatures[row % 4], min_p=min_ps[row // 4], seed=row)
            for row in range(16)
        ]
    inputs = SamplingInputs.from_params(params, range(16))
    settings = (inputs.temperature, inputs.top_k, inputs.top_p, inputs.min_p)
    assert sampler_mode(*settings, 300) == mode
    cheap = jax.jit(functools.partial(sample, mode=mode))(logits, inputs)
    general = jax.jit(functools.partial(sample, mode="filtered"))(logits, inputs)
    np.testing.assert_array_equal(np.asarray(cheap), np.asarray(general))
    greedy_rows = inputs.temperature < 1e-5
    np.testing.assert_array_equal(
        np.asarray(cheap)[greedy_rows], np.asarray(logits).argmax(axis=-1)[greedy_rows]
    )
    if mode == "top-k":  # min_p = 1 keeps the top token alone
        np.testing.assert_array_equal(
            np.asarray(cheap)[4:8], np.asarray(logits).argmax(axis=-1)[4:8]
        )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 2.0, np.inf, np.nan]), min_size=8, max_size=8
    )
)
def test_the_unfused_argmax_is_argmax_with_ties_infinities_and_nans(values):
    rows = jnp.asarray(np.array([values, values[::-1]], np.float32))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(sampler_module.noisy_argmax, static_argnums=1)(rows, False)),
        np.asarray(jnp.argmax(rows, axis=-1)),
    )


@pytest.mark.parametrize("mode", ["random", "top-k", "filtered"])
def test_both_argmaxes_draw_the_same_tokens(mode):
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(16, 300)).astype(np.float32) * 3)
    params = [SamplingParams(temperature=0.5 + row / 8, top_k=20, seed=row) for row in range(16)]
    inputs = SamplingInputs.from_params(params, range(16))
    fused, unfused = (
        jax.jit(functools.partial(sample, mode=mode, fused_argmax=fused))(logits, inputs)
        for fused in (True, False)
    )
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(unfused))


def test_only_the_filtering_sampler_branches_on_device_values():
    """A `lax.cond` in the sampler makes a GPU wait for the model step before the host may go
    on (XLA reads the predicate on the host), so the common modes must not have one."""
    logits = jax.ShapeDtypeStruct((8, 300), jnp.float32)
    inputs = SamplingInputs.from_params([SamplingParams()] * 8, [0] * 8)
    for mode in SAMPLER_MODES:
        text = jax.jit(functools.partial(sample, mode=mode)).lower(logits, inputs).as_text()
        has_branch = "stablehlo.case" in text or "stablehlo.if" in text
        assert has_branch == (mode == "filtered"), mode


def test_the_top_k_mode_equals_the_general_sampler_with_ties_and_few_candidates():
    """With 16 candidate blocks of 4 tokens, top_k <= 16 needs no full sort, even when the
    k-th largest logit is tied with logits outside the candidates (logits on a coarse grid):
    tokens and thresholds equal a full sort's."""
    rng = np.random.default_rng(6)
    logits = np.round(rng.normal(size=(48, 300)) * 2) / 2  # many ties
    logits[::3] = rng.normal(size=(16, 300))  # and some rows without
    settings = [(1, 1.0), (3, 0.5), (16, 0.95), (16, 0.8), (16, 0.6), (8, 0.9)]
    params = [
        SamplingParams(
            temperature=0.0 if row % 7 == 0 else 0.9,
            top_k=settings[row % 6][0],
            top_p=settings[row % 6][1],
            seed=row,
        )
        for row in range(48)
    ]
    inputs = SamplingInputs.from_params(params, range(48))
    logits = jnp.asarray(logits.astype(np.float32))
    few = functools.partial(sample, candidate_block_size=4, num_candidate_blocks=16)
    top_k_mode = jax.jit(functools.partial(few, mode="top-k"))(logits, inputs)
    # All 75 blocks of 4 as candidates: a full sort of every row.
    sort = functools.partial(sample, candidate_block_size=4, num_candidate_blocks=75)
    sorted_tokens = jax.jit(functools.partial(sort, mode="filtered"))(logits, inputs)
    np.testing.assert_array_equal(np.asarray(top_k_mode), np.asarray(sorted_tokens))
    # The kept sets themselves: the thresholds equal those of a full sort (75 blocks of 4).
    scaled = logits / 0.9
    row_max = scaled.max(-1)
    ratio = jnp.exp(scaled - row_max[:, None])
    top_k, top_p = jnp.asarray(inputs.top_k), jnp.asarray(inputs.top_p)
    filtered = jnp.ones(48, bool)

    def thresholds(num_blocks, fallback):
        return sampler_module._top_k_top_p_threshold(
            scaled,
            ratio,
            row_max,
            top_k,
            top_p,
            jnp.asarray(inputs.min_p),
            filtered,
            4,
            num_blocks,
            fallback,
        )

    np.testing.assert_array_equal(thresholds(16, False), thresholds(75, True))


@settings(max_examples=40, deadline=None)
@given(
    vocab_size=st.integers(1, 300),
    k=st.integers(1, 20),
    block_size=st.sampled_from([1, 4, 32]),
    levels=st.sampled_from([3, 1000]),
    seed=st.integers(0, 2**16),
)
def test_top_k_by_blocks_equals_lax_top_k(vocab_size, k, block_size, levels, seed):
    """Values, ids and the order of ties (few levels: many) equal `lax.top_k`'s."""
    k = min(k, vocab_size)
    values = np.random.default_rng(seed).integers(0, levels, (5, vocab_size)).astype(np.float32)
    top, ids = sampler_module.top_k(jnp.asarray(values), k, block_size)
    expected_top, expected_ids = jax.lax.top_k(jnp.asarray(values), k)
    np.testing.assert_array_equal(top, expected_top)
    np.testing.assert_array_equal(ids, expected_ids)


def test_noise_is_finite_at_the_extreme_bits():
    """The top 24-bit value would round to 1.0 in float32, giving +inf noise; a banned
    token's -inf plus it is NaN, which argmax would pick."""
    bits = jnp.array([0, 255, 0xFFFF_FF00, 0xFFFF_FFFF], jnp.uint32)
    uniform = np.asarray(sampler_module.uniform_open(bits))
    assert ((uniform > 0) & (uniform < 1)).all()
    assert np.isfinite(-np.log(-np.log(uniform))).all()


@pytest.mark.parametrize("mode", ["random", "filtered"])
def test_banned_tokens_are_never_sampled(mode):
    """Every token but a few is -inf, over many seeds and steps of a vocabulary-sized row: each
    of ~10^6 noise draws could be the one at the top of the uniform range."""
    vocab, num_rows = 151_936, 64
    allowed = np.array([3, 77, 100_000])
    logits = np.full((num_rows, vocab), -np.inf, np.float32)
    logits[:, allowed] = 0.0
    params = [
        SamplingParams(seed=seed, top_p=0.9 if mode == "filtered" else 1.0)
        for seed in range(num_rows)
    ]
    for step in range(4):
        inputs = SamplingInputs.from_params(params, [step] * num_rows)
        tokens = np.asarray(
            jax.jit(sample, static_argnames="mode")(jnp.asarray(logits), inputs, mode=mode)
        )
        assert np.isin(tokens, allowed).all()


def test_a_tied_tokens_rank_counts_every_token_as_likely():
    """As vLLM ranks: the tokens whose logprob is at least the token's, itself included."""
    logits = jnp.asarray([[2.0, 5.0, 5.0, 1.0, 5.0]])
    values = np.asarray(token_logprobs(logits, jnp.asarray([2]), num_top=2))
    logprob, rank, *top_ids = values[0, :4]
    assert rank == 3
    assert logprob == pytest.approx(5.0 - np.log(np.exp(logits[0]).sum()), abs=1e-6)
    assert top_ids == [1, 2]  # ties: the lower index first, as lax.top_k
