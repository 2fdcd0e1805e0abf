"""The workload generators: shapes, sharing, order, seeds, traces (pure Python + numpy)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from support.repo import assert_import_leaves_out

from jaxllm.research import workloads as w


def tokens(requests) -> list[list[int]]:
    return [r.prompt_token_ids.tolist() for r in requests]


def test_shared_prefix_groups_share_exactly_their_prefix():
    requests = w.shared_prefix(3, 4, 40, 8, 5, seed=1)
    assert len(requests) == 12
    assert all(r.num_prompt_tokens == 48 and r.max_tokens == 5 for r in requests)
    assert all(r.prompt_token_ids.dtype == np.int32 for r in requests)
    for g in range(3):
        group = tokens(requests[4 * g : 4 * g + 4])
        assert all(p[:40] == group[0][:40] for p in group)
        assert len({tuple(p[40:]) for p in group}) == 4, "questions are distinct"
    assert len({tuple(p[:40]) for p in tokens(requests)}) == 3, "prefixes are distinct"


def test_shared_prefix_orders_are_permutations():
    grouped = tokens(w.shared_prefix(3, 4, 16, 4, 1, seed=2))
    interleaved = tokens(w.shared_prefix(3, 4, 16, 4, 1, order="interleaved", seed=2))
    shuffled = tokens(w.shared_prefix(3, 4, 16, 4, 1, order="shuffled", seed=2))
    assert interleaved == [grouped[4 * g + p] for p in range(4) for g in range(3)]
    assert sorted(shuffled) == sorted(grouped) and shuffled != grouped
    with pytest.raises(ValueError, match="order"):
        w.shared_prefix(1, 1, 1, 1, 1, order="sorted")


def test_workloads_are_seeded():
    assert tokens(w.shared_prefix(2, 2, 8, 2, 1, seed=5)) == tokens(
        w.shared_prefix(2, 2, 8, 2, 1, seed=5)
    )
    assert tokens(w.shared_prefix(2, 2, 8, 2, 1, seed=5)) != tokens(
        w.shared_prefix(2, 2, 8, 2, 1, seed=6)
    )
    assert tokens(w.multi_turn_chat(2, 2, 4, 2, 2, seed=3)) == tokens(
        w.multi_turn_chat(2, 2, 4, 2, 2, seed=3)
    )
    high = max(max(p) for p in tokens(w.prefix_repetition(50, 4, 8, 8, 1, vocab_size=20)))
    assert high < 20


def test_multi_turn_prompts_extend_the_conversation_round_robin():
    system, user, output = 10, 3, 4
    requests = w.multi_turn_chat(3, 4, system, user, output, seed=0)
    assert len(requests) == 12
    prompts = tokens(requests)
    for c in range(3):
        turns = [prompts[3 * t + c] for t in range(4)]  # round robin: turn t of conversation c
        for t, prompt in enumerate(turns):
            assert len(prompt) == system + (t + 1) * user + t * output
            if t:
                assert prompt[: len(turns[t - 1])] == turns[t - 1]
    assert all(r.max_tokens == output for r in requests)
    assert len({tuple(p[:system]) for p in prompts}) == 1, "one shared system prompt"
    separate = tokens(w.multi_turn_chat(3, 1, system, user, output, shared_system_prompt=False))
    assert len({tuple(p[:system]) for p in separate}) == 3


def test_prefix_repetition_draws_prefixes_with_zipf_skew():
    requests = w.prefix_repetition(400, 5, 16, 4, 2, zipf_exponent=1.5, seed=0)
    prefixes = sorted({tuple(p[:16]) for p in tokens(requests)})
    assert len(prefixes) == 5
    counts = sorted(sum(tuple(p[:16]) == q for p in tokens(requests)) for q in prefixes)
    assert counts[-1] > 400 / (1 + 2**-1.5 + 3**-1.5 + 4**-1.5 + 5**-1.5) * 0.8  # the hot one
    assert counts[-1] > 4 * counts[0]
    uniform = w.prefix_repetition(400, 5, 16, 4, 2, seed=0)
    uniform_counts = [sum(tuple(p[:16]) == q for p in tokens(uniform)) for q in prefixes]
    assert min(uniform_counts) > 50 and max(uniform_counts) < 110


def test_hot_prefix_with_scans_layout():
    requests = w.hot_prefix_with_scans(2, 6, 3, prefix_len=4, suffix_len=1, output_len=1, seed=0)
    assert len(requests) == 2 * (6 + 3)
    heads = [tuple(p[:4]) for p in tokens(requests)]
    hot = heads[0]
    pattern = [head == hot for head in heads]
    round_pattern = [True, False] * 3 + [False] * 3
    assert pattern == round_pattern * 2
    assert len(set(heads)) == 1 + 2 * (3 + 3), "every other prefix is a one-off"


def test_poisson_arrivals():
    requests = w.with_poisson_arrivals(w.shared_prefix(10, 10, 4, 4, 1), 50.0, seed=0)
    times = np.array([r.arrival_time for r in requests])
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    assert 1 / 50 * 0.7 < np.diff(times).mean() < 1 / 50 * 1.3
    with pytest.raises(ValueError):
        w.with_poisson_arrivals(requests, 0.0)
    with pytest.raises(ValueError, match="finite"):
        w.with_poisson_arrivals(requests, float("nan"))
    tagged = [
        w.Request(r.prompt_token_ids, r.max_tokens, metadata={"session": 1}) for r in requests
    ]
    assert all(r.metadata == {"session": 1} for r in w.with_poisson_arrivals(tagged, 50.0))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_token_ids": np.array([], np.int32)}, "non-empty"),
        ({"prompt_token_ids": np.array([1.5])}, "token ids"),
        ({"prompt_token_ids": np.array([-1])}, r"\[0, 2\*\*31\)"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer"),
        ({"arrival_time": float("nan")}, "arrival_time must be a finite number"),
        ({"arrival_time": -1.0}, "arrival_time must be a finite number"),
        ({"metadata": "session"}, "metadata must be an object"),
    ],
)
def test_a_request_refuses_what_no_run_could_replay(fields, message):
    with pytest.raises(ValueError, match=message):
        w.Request(**({"prompt_token_ids": np.array([1, 2]), "max_tokens": 3} | fields))


def test_numpy_max_tokens_are_stored_as_ints(tmp_path):
    request = w.Request(np.arange(1, 5), np.int64(3))
    assert type(request.max_tokens) is int
    w.save_trace(tmp_path / "trace.jsonl", [request])  # JSON takes it
    assert w.load_trace(tmp_path / "trace.jsonl")[0].max_tokens == 3


def test_trace_round_trip(tmp_path):
    requests = w.with_poisson_arrivals(w.multi_turn_chat(2, 2, 5, 2, 3), 10.0)
    path = tmp_path / "trace.jsonl"
    w.save_trace(path, requests)
    loaded = w.load_trace(path)
    assert tokens(loaded) == tokens(requests)
    assert [r.max_tokens for r in loaded] == [r.max_tokens for r in requests]
    assert [r.arrival_time for r in loaded] == [r.arrival_time for r in requests]


def test_mooncake_trace_hash_ids_share_blocks(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    records = [
        {"timestamp": 0, "input_length": 10, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 12, "output_length": 2, "hash_ids": [7, 8, 5]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    first, second = w.load_trace(path, hash_block_size=4)
    assert first.num_prompt_tokens == 10 and second.num_prompt_tokens == 12
    a, b = first.prompt_token_ids, second.prompt_token_ids
    assert np.array_equal(a[:8], b[:8]) and not np.array_equal(a[8:10], b[8:10])
    assert (first.max_tokens, second.max_tokens) == (4, 2)
    assert (first.arrival_time, second.arrival_time) == (0.0, 1.5)
    again = w.load_trace(path, hash_block_size=4)
    assert tokens(again) == tokens([first, second])


def test_bad_trace_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 3}\n{"prompt_token_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*max_tokens"):
        w.load_trace(path)
    path.write_text('{"hash_ids": [1], "input_length": 9, "max_tokens": 1}\n')
    with pytest.raises(ValueError, match=r":1: .*input_length"):
        w.load_trace(path, hash_block_size=4)
    for line in (
        "{not json",
        '{"prompt_token_ids": [1, 2], "max_tokens": "3"}',
        '{"prompt_token_ids": [1.5, 2], "max_tokens": 3}',
        '{"prompt_token_ids": [1, 2], "max_tokens": 3, "timestamp": NaN}',
        '{"hash_ids": [1], "input_length": -2, "max_tokens": 1}',
        '{"hash_ids": [1.7], "input_length": 2, "max_tokens": 1}',
        '{"hash_ids": ["12"], "input_length": 2, "max_tokens": 1}',
        '{"hash_ids": [1], "input_length": true, "max_tokens": 1}',
    ):
        path.write_text('{"prompt_token_ids": [1, 2], "max_tokens": 3}\n' + line + "\n")
        with pytest.raises(ValueError, match=r"bad.jsonl:2: bad trace record"):
            w.load_trace(path, hash_block_size=4)


@pytest.mark.parametrize(
    ("argv", "count", "length"),
    [
        (["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3"], 6, 2176),
        (["--workload", "multi-turn", "--conversations", "2", "--turns", "2"], 4, None),
        (["--workload", "prefix-repetition", "--num-requests", "7", "--prefix-len", "8"], 7, 136),
        (["--workload", "hot-prefix-scans", "--rounds", "1"], 32, 17),
    ],
)
def test_workload_from_arguments(argv, count, length):
    parser = argparse.ArgumentParser()
    w.add_workload_arguments(parser)
    requests = w.workload_from_arguments(parser.parse_args(argv))
    assert len(requests) == count
    if length is not None:
        assert requests[0].num_prompt_tokens == length


def test_workloads_import_no_jax():
    assert_import_leaves_out(
        "jaxllm.research.workloads, jaxllm.research.cache_sim", {"jax", "flax", "matplotlib"}
    )
