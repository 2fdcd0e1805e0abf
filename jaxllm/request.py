"""The engine's record of one request, and the `RequestOutput` built once it finishes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from jaxllm.detokenizer import IncrementalDetokenizer, StopStrings, decode_tokens, known_ids
from jaxllm.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from jaxllm.sampling_params import SEED_LIMIT, SamplingParams
from jaxllm.sched import Sequence


def completion_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of completion `index` of a request of `params.n`: a stream of its own. The
    first alone computes the prompt's logprobs (the request's), the others reuse its KV."""
    seed = (params.sampling_seed + index) % SEED_LIMIT
    field = "_derived_seed" if params.seed is None else "seed"
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, prompt_logprobs=prompt_logprobs, **{field: seed})


class TokenTexts:
    """Each token's text alone, as logprobs name it; tokens not seen before are decoded in
    one batch and kept. NOTE: one tokenizer call per token costs ~15 us, and random weights
    spread top tokens over the whole vocabulary."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, tokens: list[int]) -> dict[int, str]:
        new = sorted(set(tokens).difference(self._texts))
        known = known_ids(self.tokenizer, new)
        # NOTE: transformers < 5.24 decodes an empty batch as one empty sequence.
        texts = self.tokenizer.batch_decode([[token] for token in known]) if known else []
        self._texts |= dict.fromkeys(new, "") | dict(zip(known, texts, strict=True))
        return self._texts


@dataclass(eq=False)
class Request:
    """The engine's record of one request: the sequences of its `n` completions (the first
    one's prefill fills the prefix cache for the others), its prompt text and times."""

    seqs: list[Sequence]
    prompt: str | None
    metrics: RequestMetrics

    @property
    def request_id(self) -> int:
        return self.seqs[0].seq_id

    def output(self, token_texts: TokenTexts) -> RequestOutput:
        """The output of the request, once all its completions finished."""
        first = self.seqs[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(index, token_texts) for index in range(len(self.seqs))],
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs(token_texts),
        )

    def prompt_logprobs(self, token_texts: TokenTexts) -> PromptLogprobs | None:
        """The prompt's logprobs (the first completion computes them), once computed; None
        unless its params ask for them."""
        seq = self.seqs[0]
        if seq.params.prompt_logprobs is None:
            return None
        tokens = seq.prompt_token_ids[1:]
        rows = seq.prompt_logprobs[: len(tokens)]
        logprobs = _logprobs(tokens, rows, seq.params.prompt_logprobs, token_texts, seq.params)
        return [None, *logprobs]

    def logprobs(
        self, index: int, token_texts: TokenTexts, start: int = 0, stop: int | None = None
    ) -> SampleLogprobs | None:
        """Completion `index`'s logprobs of its output tokens `start:stop`, as its output holds
        them; None unless its params ask for them."""
        seq = self.seqs[index]
        if seq.params.logprobs is None:
            return None
        tokens, rows = seq.output_token_ids[start:stop], seq.output_logprobs[start:stop]
        return _logprobs(tokens, rows, seq.params.logprobs, token_texts, seq.params)

    def _completion(self, index: int, token_texts: TokenTexts) -> CompletionOutput:
        seq, tokenizer = self.seqs[index], token_texts.tokenizer
        params, tokens, rows = seq.params, seq.output_token_ids, seq.output_logprobs
        stop_strings: StopStrings | None = seq.stop_strings  # `Engine.new_request` made it
        if not params.detokenize:
            text = ""
        elif stop_strings is not None and stop_strings.text_end is not None:
            text = stop_strings.text
        else:  # NOTE: as in vLLM, the stop token that ended it is not in the text unless asked
            stopped = seq.finish_reason == "stop" and seq.stops_at(tokens[-1])
            kept = tokens[:-1] if stopped and not params.include_stop_str_in_output else tokens
            text = decode_tokens(tokenizer, kept, params.skip_special_tokens)
            if text.endswith("\ufffd"):  # NOTE: an incomplete last character is left out, as vLLM's
                detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
                detokenizer.step(kept)
                text = detokenizer.text
        logprobs = self.logprobs(index, token_texts)
        cumulative_logprob = None if logprobs is None else sum((float(r[0]) for r in rows), 0.0)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=_stop_reason(seq, stop_strings, tokenizer.eos_token_id),
        )


def _stop_reason(
    seq: Sequence, stop_strings: StopStrings | None, eos: int | None
) -> str | int | None:
    """The stop string or stop token that ended `seq`, as vLLM names them: None for the
    tokenizer's `eos` (unless ignored), a grammar's end and length; generation_config's other
    eos ids are stop tokens."""
    if seq.finish_reason != "stop":
        return None
    if stop_strings is not None and stop_strings.matched is not None:
        return stop_strings.matched
    last = seq.output_token_ids[-1]
    if last == eos and not seq.params.ignore_eos:
        return None
    return last if last in seq.stop_token_ids else None


def _logprobs(
    tokens: list[int],
    rows: list[np.ndarray],
    wanted: int,
    token_texts: TokenTexts,
    params: SamplingParams,
) -> SampleLogprobs:
    """{token id: Logprob} of each token and of the `wanted` most likely ones, from its row
    of the device's logprobs (`sampler.token_logprobs`), built as they are read."""
    table = np.stack(rows) if rows else np.zeros((0, 2), np.float32)
    texts = token_texts if params.detokenize else dict.fromkeys  # each token's text None, as vLLM's
    return SampleLogprobs(list(tokens), table, wanted, texts)
