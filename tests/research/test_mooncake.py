"""The synthetic Mooncake-format trace: its records, its sharing, its arrivals, its command line
(pure Python + numpy)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from jaxllm.research import workloads as w
from jaxllm.research.cache_sim import make_config, simulate
from jaxllm.research.mooncake import main, synthetic_trace, write_jsonl

BLOCK = 16


def test_records_have_mooncakes_fields_and_consistent_lengths():
    records = synthetic_trace(
        500, num_prefixes=10, prefix_blocks=(2, 3), own_blocks=(1, 2), output_length=(4, 9),
        request_rate=50.0, hash_block_size=BLOCK, seed=3,
    )  # fmt: skip
    assert len(records) == 500
    for record in records:
        assert set(record) == {"timestamp", "input_length", "output_length", "hash_ids"}
        num_blocks = len(record["hash_ids"])
        assert 3 <= num_blocks <= 5
        assert (num_blocks - 1) * BLOCK < record["input_length"] <= num_blocks * BLOCK
        assert 4 <= record["output_length"] <= 9
    timestamps = [record["timestamp"] for record in records]
    assert timestamps[0] == 0 and timestamps == sorted(timestamps)
    assert all(isinstance(t, int) for t in timestamps)
    # 500 requests at 50 a second: about 10 s (the Poisson process's sd is 0.45 s).
    assert 8_000 < timestamps[-1] < 12_000
    assert synthetic_trace(20, seed=1) == synthetic_trace(20, seed=1) != synthetic_trace(20)


def test_prefixes_are_shared_with_zipf_popularity_and_own_blocks_are_not():
    records = synthetic_trace(2000, num_prefixes=8, prefix_blocks=(2, 2), own_blocks=(1, 1))
    prefixes = Counter(tuple(record["hash_ids"][:2]) for record in records)
    assert len(prefixes) == 8
    counts = [count for _, count in prefixes.most_common()]
    # Zipf 1.0 over 8 prefixes: the most popular one is drawn with p = 1 / H(8) = 0.37.
    assert 0.33 < counts[0] / 2000 < 0.41 and counts[0] > 3 * counts[-1]
    own = [record["hash_ids"][2] for record in records]
    assert len(set(own)) == 2000 and not set(own) & {h for p in prefixes for h in p}


def test_the_trace_loads_and_its_prefixes_hit(tmp_path):
    path = tmp_path / "trace.jsonl"
    records = synthetic_trace(
        60, num_prefixes=3, prefix_blocks=(2, 2), own_blocks=(1, 1), output_length=(2, 2),
        request_rate=1.0, hash_block_size=BLOCK,
    )  # fmt: skip
    write_jsonl(path, records)
    requests = w.load_trace(path, hash_block_size=BLOCK)
    assert [r.num_prompt_tokens for r in requests] == [r["input_length"] for r in records]
    assert [r.arrival_time for r in requests] == [r["timestamp"] / 1000 for r in records]
    config = make_config(requests, block_size=BLOCK, prefill_tile=16)
    gaps = np.diff([r.arrival_time for r in requests])
    result = simulate(requests, config, arrival="time", step_time=0.001)
    # One request at a time (2 steps of 1 ms each, arrivals at least 2 ms apart): all but each
    # prefix's first use hit the prefix's two blocks.
    assert gaps.min() >= 0.002
    assert result.num_hit_tokens == (60 - 3) * 2 * BLOCK


def test_command_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    assert main([str(path), "--num-requests", "7", "--request-rate", "2", "--seed", "4"]) == 0
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == synthetic_trace(7, request_rate=2.0, seed=4)
    with pytest.raises(ValueError, match="request_rate"):
        synthetic_trace(3, request_rate=0.0)
    for flags in (
        ["--num-requests", "0"],
        ["--prefix-blocks", "4", "1"],
        ["--request-rate", "nan"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([str(tmp_path / "refused.jsonl"), *flags])
        assert exit_info.value.code == 2 and not (tmp_path / "refused.jsonl").exists()
    assert np.isfinite([json.loads(line)["timestamp"] for line in lines]).all()
