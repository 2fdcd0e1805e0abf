"""The host side of the logits processors (`jaxllm.model.logits_processors`): each sequence's
slot, the rows written into it, and the bans (bad words, the stop tokens before min_tokens).

A sequence that asks for penalties, a bias, allowed tokens, bad words or min_tokens gets a slot
when it is admitted and gives it back when it is preempted, finishes or is released; the step
that admits it writes its rows whole from the tokens the host holds. The plan edits the bias row
where the bans change (`banned_now`). Its stop tokens are banned until min_tokens are out
(vLLM's min_tokens), which the plan knows from the positions it computes. A bad word of several
tokens bans its last token while the output ends with the ones before it (unless that would ban
every allowed token), which the plan reads from the output the host holds, so the engine applies
a step's tokens before it plans the next for such sequences (`Scheduler.needs_host_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxllm.model.inputs import IN_PROMPT

if TYPE_CHECKING:
    from jaxllm.sched.sequence import Sequence


@dataclass
class SequenceProcessors:
    """What a sequence's logits processors need besides its params.

    Attributes:
        vocab_size: the model's vocabulary.
        bad_words: each bad word's token ids (vLLM's tokenization: the word, and the word after
            a space).
        slot: the slot held while running; None otherwise.
        banned: the tokens `banned_now` banned in the slot's bias row, as the device has it.
    """

    vocab_size: int
    bad_words: tuple[tuple[int, ...], ...] = ()
    slot: int | None = None
    banned: frozenset[int] = frozenset()

    @property
    def has_multi_token_words(self) -> bool:
        return any(len(word) > 1 for word in self.bad_words)


class ProcessorSlots:
    """The slots of the device state: one per running sequence that asks, so `max_num_seqs`
    suffice. A slot given back is written anew by a step planned later, which runs after
    every step that used it.

    Attributes:
        free: the slots no sequence holds.
        new: ids of the sequences given a slot since the last plan (`take_new`).
        num_needing_host_tokens: live sequences with bad words of several tokens.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        self.free = list(range(self.num_slots))
        self.new: set[int] = set()
        self.num_needing_host_tokens = 0

    def count(self, seq: Sequence, change: int) -> None:
        """Counts a sequence that became live (`change` 1) or finished (-1)."""
        if seq.processors is not None and seq.processors.has_multi_token_words:
            self.num_needing_host_tokens += change

    def assign(self, seq: Sequence) -> None:
        if seq.processors is not None:
            seq.processors.slot = self.free.pop()
            self.new.add(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        if seq.processors is not None and seq.processors.slot is not None:
            self.free.append(seq.processors.slot)
            seq.processors.slot = None
            self.new.discard(seq.seq_id)

    @property
    def num_held(self) -> int:
        return self.num_slots - len(self.free)

    def take_new(self) -> frozenset[int]:
        new, self.new = frozenset(self.new), set()
        return new


def changes_logits(seq: Sequence) -> bool:
    """Whether its logits processors change its logits: not once the ban of min_tokens alone
    is lifted for good."""
    processors = seq.processors
    return processors is not None and (seq.params.processes_logits or bool(processors.banned))


def bad_word_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's token ids of bad words: each word as it is, and after a space where that gives
    the same number of tokens and a different first token.

    Raises:
        ValueError: a word of no tokens (whitespace alone), as vLLM does.
    """
    ids = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"SamplingParams.bad_words: {word!r} is no token (bans nothing)")
        ids.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            ids.append(tuple(spaced))
    return tuple(ids)


def one_token_words(words: tuple[tuple[int, ...], ...]) -> set[int]:
    """The tokens of the bad words of one token: banned at every step (`static_bias`)."""
    return {word[0] for word in words if len(word) == 1}


def banned_now(seq: Sequence, num_outputs: int) -> frozenset[int]:
    """The tokens banned where `seq` samples the output token that follows `num_outputs` of
    them: its stop tokens while fewer than min_tokens are out; the last tokens of the
    multi-token bad words whose other tokens end the output, unless with the other bans they
    would leave none of its allowed tokens (`Engine.new_request` refuses the other bans alone
    doing so): only allowed tokens are ever sampled."""
    output, words, vocab = seq.output_token_ids, seq.processors.bad_words, seq.processors.vocab_size
    banned = frozenset(
        word[-1]
        for word in words
        if 1 < len(word) <= len(output) + 1
        and tuple(output[len(output) - len(word) + 1 :]) == word[:-1]
    )
    stops = frozenset()
    if num_outputs < seq.params.min_tokens:  # NOTE: a tokenizer's eos may lie past the model's
        stops = frozenset(token for token in seq.stop_token_ids if token < vocab)
    allowed = seq.params.allowed_token_ids
    if banned and allowed is not None and banned | stops | one_token_words(words) >= {*allowed}:
        banned = frozenset()
    return banned | stops


def static_bias(seq: Sequence) -> np.ndarray:
    """[V] float32: the logit bias, -inf outside the allowed tokens and at one-token bad words."""
    params, vocab = seq.params, seq.processors.vocab_size
    bias = np.zeros(vocab, np.float32)
    for token, value in (params.logit_bias or {}).items():
        bias[token] += value
    if params.allowed_token_ids is not None:
        allowed = np.zeros(vocab, bool)
        allowed[list(params.allowed_token_ids)] = True
        bias[~allowed] = -np.inf
    bias[list(one_token_words(seq.processors.bad_words))] = -np.inf
    return bias


class SlotWrite(NamedTuple):
    """The rows a slot is written with (`logits_processors.write_slot`)."""

    slot: int
    tokens: np.ndarray  # [V] int32
    bias: np.ndarray  # [V] float32
    penalties: np.ndarray  # [3] float32


def slot_write(seq: Sequence, num_outputs: int) -> SlotWrite:
    """Its slot's rows from the tokens the host holds, the bans (`banned_now`) in; records
    them."""
    proc = seq.processors
    tokens = np.bincount(seq.output_token_ids, minlength=proc.vocab_size).astype(np.int32)
    tokens[seq.token_ids[: seq.num_prompt_tokens]] |= IN_PROMPT
    bias = static_bias(seq)
    proc.banned = banned_now(seq, num_outputs)
    bias[list(proc.banned)] = -np.inf
    params = seq.params
    penalties = [params.presence_penalty, params.frequency_penalty, params.repetition_penalty]
    return SlotWrite(proc.slot, tokens, bias, np.array(penalties, np.float32))


def ban_edits(seq: Sequence, num_outputs: int) -> list[tuple[int, int, float]]:
    """(slot, token, value) for each bias entry whose ban (`banned_now`) starts or ends now;
    records them."""
    proc = seq.processors
    banned = banned_now(seq, num_outputs)
    if banned == proc.banned:
        return []
    lifted = sorted(proc.banned - banned)
    static = static_bias(seq)[lifted] if lifted else []
    edits = [(proc.slot, token, -np.inf) for token in sorted(banned - proc.banned)]
    edits += [(proc.slot, token, float(value)) for token, value in zip(lifted, static, strict=True)]
    proc.banned = banned
    return edits


class ProcessorPlan(NamedTuple):
    """A step's logits processing (`StepPlan.processors`).

    Attributes:
        rows: [2, S] int32: each row's slot, whose processors apply, then the slot in which
            its sampled token is counted; -1 for none, and where the row does not sample its
            sequence's next token (mid-prompt, the raw logits of prompt logprobs).
        writes: slots written before the step.
        edits: bias entries set before the step: [E] slots, [E] tokens, [E] values.
    """

    rows: np.ndarray
    writes: list[SlotWrite]
    edits: tuple[np.ndarray, np.ndarray, np.ndarray] | None


def processor_plan(
    seqs: list[Sequence],
    samples: list[bool],
    num_outputs: list[int],
    num_sampled: int,
    written: frozenset[int],
) -> ProcessorPlan | None:
    """The processing of a step of `seqs` (rows in order; `num_outputs`: the output tokens
    before each row's sampled one), None when no row asks for any; `written`: the ids of
    sequences whose slot is new, written whole: for the row's token, or where the row samples
    none (a prompt's chunk short of its end), for the token that follows all it holds."""
    rows = np.full((2, num_sampled), -1, np.int32)
    writes, edits = [], []
    for index, (seq, sampled) in enumerate(zip(seqs, samples, strict=True)):
        proc = seq.processors
        if proc is None:
            continue
        rows[:, index] = proc.slot if sampled else -1
        if seq.seq_id in written:
            writes.append(slot_write(seq, num_outputs[index] if sampled else seq.num_output_tokens))
        elif sampled and (proc.has_multi_token_words or seq.params.min_tokens):
            edits += ban_edits(seq, num_outputs[index])  # NOTE: a row that samples needs them
    if not writes and (rows[0] < 0).all():
        return None
    if not edits:
        return ProcessorPlan(rows, writes, None)
    slots, tokens, values = zip(*edits, strict=True)
    arrays = np.array(slots, np.int32), np.array(tokens, np.int32), np.array(values, np.float32)
    return ProcessorPlan(rows, writes, arrays)
