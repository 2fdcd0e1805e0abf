"""3,000 requests of random lengths and random sampling settings through an engine whose cache
forces preemption, in ten calls: every request returns, in order, with the finish reason its
settings call for; the block pool ends free; nothing is compiled after the first call (which
compiles the sampler variants start-up leaves to their first use); and the process's memory stays
flat after the first call (docs/reliability.md records a run:
`python -m pytest -m slow -s tests/engine/test_soak.py`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from support.hf import VOCAB_SIZE

from jaxllm import LLM, SamplingParams

NUM_REQUESTS = 3000
NUM_CALLS = 10
MAX_MODEL_LEN = 256
EOS = (7, 200)


def random_params(rng: np.random.Generator) -> SamplingParams:
    # A few requests run into max_model_len.
    max_tokens = 400 if rng.random() < 0.02 else int(rng.choice([1, 2, rng.integers(1, 24)]))
    fields = dict(
        temperature=float(rng.choice([0.0, 0.5, 1.0, 1.5])),
        top_k=int(rng.choice([0, 1, 5, 50])),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.1])),
        max_tokens=max_tokens,
        min_tokens=int(rng.integers(0, min(max_tokens, 8) + 1)) if rng.random() < 0.3 else 0,
        ignore_eos=bool(rng.random() < 0.3),
        seed=int(rng.integers(0, 2**63)) if rng.random() < 0.5 else None,
    )
    if rng.random() < 0.5:
        fields["stop_token_ids"] = rng.integers(0, VOCAB_SIZE, rng.integers(1, 16)).tolist()
    return SamplingParams(**fields)


def check_finish(tokens: list[int], params: SamplingParams, prompt_len: int, reason: str):
    """The output is what the request's stop conditions allow, and it ends for the right reason."""
    stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(EOS))
    limit = min(params.max_tokens, MAX_MODEL_LEN - prompt_len)
    assert 1 <= len(tokens) <= limit
    assert all(0 <= t < VOCAB_SIZE for t in tokens)
    # No stop token before min_tokens are out (they are banned), and nothing before the last
    # token could have stopped the request.
    assert not set(tokens[: params.min_tokens]) & stops
    for count, token in enumerate(tokens[:-1], start=1):
        assert not (token in stops and count >= params.min_tokens)
    stopped = tokens[-1] in stops and len(tokens) >= params.min_tokens
    assert reason == ("stop" if stopped else "length")
    if reason == "length":
        assert len(tokens) == limit


def rss_bytes() -> int:
    """The process's resident memory (Linux)."""
    status = Path("/proc/self/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
        * 1024
    )


@pytest.mark.slow
def test_soak(checkpoint, tmp_path):
    path = checkpoint.with_generation_config(tmp_path / "eos", eos_token_id=list(EOS))
    llm = LLM(
        str(path),
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=256,
        kvcache_block_size=16,
        num_kvcache_blocks=24,  # one and a half max_model_len requests
        dtype="float32",
        compile_at_startup=True,
    )
    assert llm.num_compilations_since_startup == 0
    rng = np.random.default_rng(7)
    lengths = np.where(rng.random(NUM_REQUESTS) < 0.9, rng.integers(1, 40, NUM_REQUESTS), 0)
    lengths = np.where(lengths == 0, rng.integers(40, MAX_MODEL_LEN, NUM_REQUESTS), lengths)
    # Some shared prefixes, for prefix hits.
    prefixes = [rng.integers(0, VOCAB_SIZE, 64).tolist() for _ in range(4)]
    prompts = []
    for length in lengths:
        tokens = rng.integers(0, VOCAB_SIZE, length).tolist()
        if length > 64 and rng.random() < 0.5:
            tokens[:64] = prefixes[rng.integers(0, 4)]
        prompts.append(tokens)
    params = [random_params(rng) for _ in range(NUM_REQUESTS)]

    start, outputs, rss = time.perf_counter(), [], []
    per_call = NUM_REQUESTS // NUM_CALLS
    for first in range(0, NUM_REQUESTS, per_call):
        batch = slice(first, first + per_call)
        outputs += llm.generate(prompts[batch], params[batch], use_tqdm=False)
        rss.append(rss_bytes())
        if first == 0:
            compiled = llm.num_compilations_since_startup
    seconds = time.perf_counter() - start

    print(
        f"soak: {NUM_REQUESTS} requests in {seconds:.0f} s, "
        f"{sum(len(o.token_ids) for o in outputs)} tokens, "
        f"{llm.engine.scheduler.num_preemptions} preemptions, "
        f"RSS after each call (MB): {[round(r / 2**20) for r in rss]}"
    )
    assert max(rss[1:]) < 1.1 * rss[0]  # after warm-up (the first call), growth < 10%
    assert llm.num_compilations_since_startup == compiled
    assert len(outputs) == NUM_REQUESTS
    for prompt, param, output in zip(prompts, params, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        check_finish(output.token_ids, param, len(prompt), output.finish_reason)
    reasons = [o.finish_reason for o in outputs]
    assert reasons.count("stop") > 100 and reasons.count("length") > 100
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert llm.cache_stats().num_hit_tokens > 0
    assert not scheduler.has_unfinished()
    scheduler.check_integrity()
    assert scheduler.block_pool.num_free_blocks == scheduler.config.num_blocks
    assert llm.cache_stats().num_used_blocks == 0
