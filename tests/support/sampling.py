"""The distribution jaxllm's sampler must draw from, and the check that draws match it."""

from __future__ import annotations

import numpy as np


def exact_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """In float64, with vLLM's filter order (as jaxllm/model/sampler.py documents): temperature,
    then min-p against the top token, then top-k, then top-p on what min-p and top-k left (the
    boundary token kept). Temperature 0 is greedy."""
    if temperature == 0.0:
        return np.eye(len(logits))[np.argmax(logits)]
    scaled = np.asarray(logits, np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = probs >= min_p * probs.max()
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        kept = np.where(keep, probs, 0.0)
        kept_sorted = kept[order] / kept.sum()
        mass_before = np.concatenate([[0.0], np.cumsum(kept_sorted)[:-1]])
        # The prefix up to and including the first token at which the mass reaches top_p.
        keep[order[mass_before >= top_p]] = False
    result = np.where(keep, probs, 0.0)
    return result / result.sum()


def assert_matches(tokens: np.ndarray, expected: np.ndarray) -> None:
    """Empirical vs exact: nothing outside the support, and a total-variation distance within
    the 99.9% quantile of what a correct sampler of as many draws shows."""
    outside = set(tokens.tolist()) - set(np.flatnonzero(expected).tolist())
    assert not outside, f"tokens outside the allowed set: {sorted(outside)}"
    empirical = np.bincount(tokens, minlength=len(expected)) / len(tokens)
    tv = 0.5 * np.abs(empirical - expected).sum()
    simulated = np.random.default_rng(0).multinomial(len(tokens), expected, size=2000)
    simulated_tv = 0.5 * np.abs(simulated / len(tokens) - expected).sum(axis=1)
    bound = np.quantile(simulated_tv, 0.999)
    assert tv <= bound, (
        f"TV {tv:.4f} > {bound:.4f} (mean for a correct sampler {simulated_tv.mean():.4f})"
    )
