"""Bad requests and bad settings fail loudly, before any work of the call, and leave the engine
usable: a valid `generate` right after each error gives the reference tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.engine import BASE_SETTINGS, MAX_MODEL_LEN, assert_idle, greedy_params
from support.hf import VOCAB_SIZE

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineConfig

GOOD_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]

# name -> (generate's arguments, the error's type, a pattern of its message)
BAD_CALLS = {
    "empty text prompt": (([""],), ValueError, "prompt 0: the prompt is empty text, of no "),
    "empty token prompt": (([GOOD_PROMPT, []],), ValueError, "prompt 1: the prompt is empty"),
    "prompt of max_model_len tokens": (
        ([[1] * MAX_MODEL_LEN],),
        ValueError,
        f"512 tokens; max_model_len={MAX_MODEL_LEN}",
    ),
    "token id past the vocabulary": (
        ([GOOD_PROMPT, [1, VOCAB_SIZE, 2]],),
        ValueError,
        "prompt 1: token id 256 is outside the model's vocabulary",
    ),
    "negative token id": (([[1, -3, 2]],), ValueError, "token id -3 is outside"),
    "float token id": (([[1, 2.5]],), ValueError, "prompt 0: token ids must be integers"),
    "neither text nor tokens": (([GOOD_PROMPT, 7.0],), ValueError, "prompt 1: expected a string"),
    "too few sampling_params": (
        ([GOOD_PROMPT, GOOD_PROMPT], [SamplingParams()]),
        ValueError,
        "got 1 sampling_params for 2 prompts",
    ),
    "too many sampling_params": (
        ([GOOD_PROMPT], [SamplingParams()] * 3),
        ValueError,
        "got 3 sampling_params for 1 prompts",
    ),
    "not a SamplingParams": (
        ([GOOD_PROMPT], [{"temperature": 0.5}]),
        ValueError,
        r"sampling_params\[0\] is not a SamplingParams",
    ),
}


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[int]:
    return checkpoint.greedy(GOOD_PROMPT, 4)


def assert_usable(llm: LLM, reference: list[int]) -> None:
    assert_idle(llm)
    (output,) = llm.generate([GOOD_PROMPT], greedy_params(4), use_tqdm=False)
    assert output.token_ids == reference
    assert_idle(llm)


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_generate_call_runs_nothing(case, llm, reference):
    arguments, error, pattern = BAD_CALLS[case]
    steps = llm.engine.stats.prefill.steps + llm.engine.stats.decode.steps
    with pytest.raises(error, match=pattern):
        llm.generate(*arguments, use_tqdm=False)
    assert llm.engine.stats.prefill.steps + llm.engine.stats.decode.steps == steps
    assert_usable(llm, reference)


def test_use_tqdm_must_be_a_bool(llm, reference):
    with pytest.raises(TypeError, match="use_tqdm must be True or False, got 'no'"):
        llm.generate([GOOD_PROMPT], use_tqdm="no")  # NOTE: a truthy string showed the bar
    assert_usable(llm, reference)


def test_flags_of_save_and_update_params_must_be_bools(llm, reference, tmp_path):
    """A truthy string must not turn them on: overwrite="false" replaced the user's files."""
    (tmp_path / "generation_config.json").write_text("mine")
    with pytest.raises(TypeError, match="overwrite must be True or False, got 'false'"):
        llm.save(tmp_path, overwrite="false")
    assert [p.name for p in tmp_path.iterdir()] == ["generation_config.json"]
    assert (tmp_path / "generation_config.json").read_text() == "mine"
    with pytest.raises(TypeError, match="donate must be True or False, got 'x'"):
        llm.update_params(llm.params, donate="x")
    assert_usable(llm, reference)


def test_bad_stream_call_fails_at_once(llm, reference):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.stream([1, 2, 10_000])
    with pytest.raises(ValueError, match="stream\\(\\) takes one prompt, got 2"):
        llm.stream([[1, 2], [3]])
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.stream("")
    assert_usable(llm, reference)


def test_bad_chat_call_runs_nothing(text_llm):
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="got 2 sampling_params for 1 prompts"):
        text_llm.chat(conversation, [SamplingParams()] * 2, use_tqdm=False)
    assert_idle(text_llm)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"enable_thinking": 0}, "enable_thinking must be True or False, got 0"),
        ({"chat_template_kwargs": {"enable_thinking": "false"}}, "enable_thinking must be"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt must be True or False"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs must be a dict"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
    ],
)
def test_chat_flags_and_template_arguments_are_checked(text_llm, settings, message):
    """A flag's truthy string ("false") would have left thinking on: the template tests
    `is false`."""
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TypeError, match=message):
        text_llm.chat(conversation, use_tqdm=False, **settings)
    assert_idle(text_llm)


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('roles must alternate') }}",  # how a template refuses a conversation
        "{% for message in messages %}",  # a syntax error
        "{{ messages | no_such_filter }}",
        "{{ messages[0].content + 1 }}",  # a TypeError inside the template
    ],
)
def test_a_failing_chat_template_is_a_value_error(template, text_llm):
    conversations = [[{"role": "user", "content": "Hi"}]] * 2
    with pytest.raises(ValueError, match="conversation 0: the chat template failed"):
        text_llm.chat(conversations, chat_template=template, use_tqdm=False)
    assert_idle(text_llm)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.1),
        ("max_tokens", 0),
        ("min_tokens", 100),
        ("stop", ""),
        ("stop_token_ids", [-1]),
        ("seed", -2),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value, llm, reference):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        dataclasses.replace(SamplingParams(), **{field: value})
    assert_usable(llm, reference)


def test_the_prefix_of_a_batch_never_runs(llm, reference):
    """One bad prompt at the end of a long batch: nothing is queued, no block is taken."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB_SIZE, 40).tolist() for _ in range(20)]
    prompts.append([1, 2, VOCAB_SIZE + 5])
    queried = llm.cache_stats().num_queried_tokens
    with pytest.raises(ValueError, match="prompt 20: token id 261"):
        llm.generate(prompts, greedy_params(4), use_tqdm=False)
    assert llm.cache_stats().num_queried_tokens == queried
    assert_usable(llm, reference)


def test_kv_cache_too_small_for_one_request(checkpoint):
    with pytest.raises(ValueError, match=r"raise num_kvcache_blocks .* or lower max_model_len"):
        LLM(str(checkpoint.path), **(BASE_SETTINGS | {"num_kvcache_blocks": 31}))


def test_every_accepted_request_fits(llm):
    """The start-up check makes any request the LLM accepts fit in an idle cache (max_tokens is
    capped by max_model_len); the scheduler's own refusal is tested in tests/sched. Here: the
    largest request possible runs."""
    assert llm.num_kvcache_blocks * 16 >= MAX_MODEL_LEN
    (output,) = llm.generate([[7] * (MAX_MODEL_LEN - 1)], greedy_params(10**6), use_tqdm=False)
    assert (len(output.token_ids), output.finish_reason) == (1, "length")


@pytest.mark.parametrize(
    ("model", "pattern"),
    [
        ("/no/such/model", "model path '/no/such/model' does not exist"),
        ("no-such-model", "does not exist"),
        (__file__, "is not a directory"),
    ],
)
def test_model_path_that_does_not_exist(model, pattern):
    with pytest.raises(FileNotFoundError, match=pattern):
        LLM(model, **BASE_SETTINGS)


def test_directory_that_is_no_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="neither a Hugging Face checkpoint"):
        LLM(str(tmp_path), **BASE_SETTINGS)


def test_max_model_len_beyond_the_model_is_refused_before_any_weight_is_read(
    checkpoint, monkeypatch
):
    from jaxllm.model import checkpoint as checkpoints

    read = lambda *_, **__: pytest.fail("the weights were read")
    monkeypatch.setattr(checkpoints, "load_hf_checkpoint", read)
    with pytest.raises(ValueError, match="more than the model's max_position_embeddings"):
        LLM(str(checkpoint.path), **(BASE_SETTINGS | {"max_model_len": 10**6}))


def test_bad_engine_arguments(checkpoint):
    path = str(checkpoint.path)
    with pytest.raises(TypeError, match="unknown arguments: max_num_sequences"):
        LLM(path, max_num_sequences=4)
    with pytest.raises(TypeError, match="not both"):
        LLM(path, memory_fraction=0.5, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
        LLM(path, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kvcache_block_size must be a power of two"):
        LLM(path, kvcache_block_size=24)
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        LLM(path, tensor_parallel_size=3)


def test_tensor_parallel_size_must_divide_the_heads(checkpoint):
    """The checkpoint has 4 query heads and 2 kv heads: 4 devices cannot share the kv heads."""
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide both num_heads"):
        LLM(str(checkpoint.path), **(BASE_SETTINGS | {"tensor_parallel_size": 4}))


def test_engine_defaults_match_the_documented_api():
    defaults = EngineConfig()
    documented = dict(
        tensor_parallel_size=1,
        max_num_seqs=512,
        max_num_batched_tokens=16384,
        max_model_len=None,
        kvcache_block_size=256,
        num_kvcache_blocks=None,
        gpu_memory_utilization=0.9,
        dtype=None,
        enable_prefix_caching=True,
        eviction_policy="lru",
        seed=0,
        compile_at_startup=None,
    )
    assert {name: getattr(defaults, name) for name in documented} == documented


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="could not be downloaded from the Hugging Face"):
        LLM("Qwen/Qwen3-0.6B", **BASE_SETTINGS)
