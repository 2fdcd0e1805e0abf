"""From token ids to text, never raising on an id the tokenizer lacks: whole outputs,
streamed deltas, and stop strings."""

from __future__ import annotations

import re
from collections.abc import Iterable

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from jaxllm.sampling_params import SamplingParams


def decode_tokens(
    tokenizer: PreTrainedTokenizerFast, token_ids: Iterable[int], skip_special_tokens: bool = True
) -> str:
    """Decodes token ids to text; ids the tokenizer lacks (`known_ids`) decode to nothing."""
    known = known_ids(tokenizer, token_ids)
    return tokenizer.decode(known, skip_special_tokens=skip_special_tokens)


def known_ids(tokenizer: PreTrainedTokenizerFast, token_ids: Iterable[int]) -> list[int]:
    """The ids the tokenizer has: negative ones and those past its vocabulary dropped (a model's
    vocab, 151,936 for Qwen3, is padded beyond the tokenizer's 151,669)."""
    size = len(tokenizer)
    return [int(t) for t in token_ids if 0 <= int(t) < size]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, for streaming output and stop strings.

    Only settled text is emitted: a character whose UTF-8 bytes span several tokens decodes to a
    trailing U+FFFD while incomplete, and is held back until later tokens complete it or show
    its bytes invalid (then the U+FFFD is genuine, and emitted). So `text` only grows. Each step
    decodes only a short window of recent tokens (vLLM's prefix/read offsets), not the whole
    output.

    Mutates: its window of recent token ids and `text` (everything emitted so far).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window: context tokens (window[:read_offset], already emitted), then new ones;
        # `_num_emitted` characters of its decoded text are in `text` or are context.
        self._window: list[int] = []
        self._read_offset = self._num_emitted = 0
        self.text = ""

    def step(self, token_ids: int | Iterable[int]) -> str:
        """Adds new token ids; returns the text they settle (possibly "")."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._window.extend(known_ids(self._tokenizer, token_ids))
        window_text = self._decode(self._window)
        # NOTE: an incomplete character is one trailing U+FFFD; all text before it is settled.
        pending = self._incomplete_bytes() if window_text.endswith("\ufffd") else 0
        incomplete = pending > 0
        end = len(window_text) - incomplete
        delta = window_text[self._num_emitted : end]
        self.text += delta
        self._num_emitted = max(self._num_emitted, end)
        if not incomplete:
            # All of the window is emitted: the tokens read last become the next context.
            self._window = self._window[self._read_offset :]
            self._read_offset = len(self._window)
            self._num_emitted = len(self._decode(self._window))
        elif len(self._window) - self._read_offset > PENDING_TOKENS:
            self._cut_before_incomplete(window_text, pending)
        return delta

    def _bytes(self) -> list[bytes]:
        tokens = self._tokenizer.convert_ids_to_tokens(self._window, self._skip_special_tokens)
        return [_byte_level_bytes(token) for token in tokens]

    def _incomplete_bytes(self) -> int:
        """How many bytes at the window's end start a character that more bytes may complete
        (its U+FFFD a placeholder); 0 where it ends whole or in an invalid sequence (a U+FFFD
        for good)."""
        match = _INCOMPLETE_CHARACTER.search(b"".join(self._bytes())[-3:])
        return 0 if match is None else len(match.group())

    def _cut_before_incomplete(self, window_text: str, pending: int) -> None:
        """Drops the window's tokens before the last token boundary at or before the incomplete
        character where the window's text splits in two (their text is emitted), so a run of
        tokens that keeps ending inside a character is decoded a few tokens at a time; `pending`:
        the incomplete character's bytes."""
        pieces = self._bytes()
        boundary = sum(map(len, pieces))
        start = boundary - pending  # the incomplete character's first byte
        for index in range(len(pieces) - 1, 0, -1):
            boundary -= len(pieces[index])
            if boundary > start:
                continue
            rest = self._decode(self._window[index:])
            if self._decode(self._window[:index]) + rest == window_text:
                self._window = self._window[index:]
                self._read_offset = 0
                self._num_emitted = len(rest) - 1  # all but its U+FFFD
                return

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


# Tokens read while the text ends inside a character before the window is cut (a run of such
# tokens would otherwise be decoded whole at every step).
PENDING_TOKENS = 8
# GPT-2's byte-level alphabet, as Qwen's tokenizer spells byte-level BPE tokens.
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}

# A lead byte and some, not all, of the bytes that may follow it, at the end (Unicode's table
# of well-formed UTF-8). NOTE: not Python's incremental decoder: it also waits after the
# invalid ED A0 .. ED BF (surrogates), which the tokenizer decodes to U+FFFD at once.
_INCOMPLETE_CHARACTER = re.compile(
    rb"(?:[\xc2-\xdf]"
    rb"|\xe0[\xa0-\xbf]?|[\xe1-\xec\xee\xef][\x80-\xbf]?|\xed[\x80-\x9f]?"
    rb"|\xf0(?:[\x90-\xbf][\x80-\xbf]?)?|[\xf1-\xf3][\x80-\xbf]{0,2}"
    rb"|\xf4(?:[\x80-\x8f][\x80-\xbf]?)?"
    rb")\Z"
)


def _byte_level_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes, as `tokenizers.decoders.ByteLevel` reads them: a token
    with characters outside the byte alphabet (an added token) as its UTF-8."""
    if all(char in _BYTE_OF_CHAR for char in token):
        return bytes(_BYTE_OF_CHAR[char] for char in token)
    return token.encode()


class StopStrings:
    """Detokenizes one request's output as it grows and finds its stop strings in the text.

    The scheduler calls it with every generated token (`sched.sequence.StopStringCheck`); it
    answers True once a stop string shows in the settled text, ending after the text of the
    first `min_tokens` tokens (vLLM's rule). Of several in one token's text, the one that ends
    first wins (then the first in `stop`), as character-by-character text would show them;
    vLLM's `check_stop_strings` takes the first in `stop` it finds. `text` is then the output
    up to it (through it with `include_stop_str_in_output`). No prompt context: the text equals
    the output tokens decoded alone, also when the prompt ends inside a multi-byte character.

    Mutates: its detokenizer, its token count and, at a hit, `text_end` and `matched`.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, params: SamplingParams) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._stops = params.stop
        self._min_tokens = params.min_tokens
        self._include = params.include_stop_str_in_output
        self._num_tokens = 0
        self.text_end: int | None = None
        self.matched: str | None = None  # the stop string found

    def __call__(self, token_id: int) -> bool:
        self._num_tokens += 1
        delta = self._detokenizer.step(token_id)
        if not delta or self._num_tokens <= self._min_tokens:
            return False
        text = self._detokenizer.text
        settled = len(text) - len(delta)  # NOTE: a hit ends in the new text
        hits = [
            (i, stop)
            for stop in self._stops
            if (i := text.find(stop, max(0, settled - len(stop) + 1))) >= 0
        ]
        if not hits:
            return False
        start, self.matched = min(hits, key=lambda hit: hit[0] + len(hit[1]))
        self.text_end = start + len(self.matched) if self._include else start
        return True

    @property
    def text(self) -> str:
        """The output up to the first stop string found, or through it (all of it decoded if
        none)."""
        return self._detokenizer.text[: self.text_end]
