"""What `LLM.stream` yields of one request: each completion's new text, tokens and logprobs."""

from __future__ import annotations

from jaxllm.detokenizer import IncrementalDetokenizer
from jaxllm.outputs import PromptLogprobs, RequestOutput, StreamDelta
from jaxllm.request import Request, TokenTexts


class RequestStream:
    """The deltas of one request's completions: `new` as the engine appends tokens, `last` from
    its output. Text that may start a stop string is held back (the last longest stop string -
    1 characters) until it cannot, unless `include_stop_str_in_output`; a completion that
    finished is left to the output, whose text ends before its stop string. Completion 0's
    first delta carries the prompt's logprobs.

    Mutates: what it has sent of each completion.
    """

    def __init__(self, request: Request, tokenizer, token_texts: TokenTexts) -> None:
        self._request, self._token_texts = request, token_texts
        self._params = params = request.seqs[0].params
        self._detokenizers = [
            IncrementalDetokenizer(tokenizer, params.skip_special_tokens) for _ in request.seqs
        ]
        stops = () if params.include_stop_str_in_output else params.stop or ()
        self._hold_back = max((len(stop) - 1 for stop in stops), default=0)
        self._sent_tokens = [0] * len(request.seqs)
        self._sent_chars = [0] * len(request.seqs)
        self._prompt_logprobs_sent = False

    def new(self) -> list[StreamDelta]:
        """The deltas of the tokens appended since the last call (none of finished
        completions). Called between engine steps: it reads the sequences."""
        deltas = []
        for i, seq in enumerate(self._request.seqs):
            start, stop = self._sent_tokens[i], seq.num_output_tokens
            if seq.is_finished or stop == start:
                continue
            tokens = seq.output_token_ids[start:stop]
            self._sent_tokens[i] = stop
            detokenizer = self._detokenizers[i]
            detokenizer.step(tokens if self._params.detokenize else [])
            sent = self._sent_chars[i]
            visible = max(sent, len(detokenizer.text) - self._hold_back)
            self._sent_chars[i] = visible
            delta = StreamDelta(
                detokenizer.text[sent:visible],
                tokens,
                i,
                logprobs=self._request.logprobs(i, self._token_texts, start, stop),
                prompt_logprobs=self._prompt_logprobs(i, None),
            )
            deltas.append(delta)
        return deltas

    def last(self, output: RequestOutput) -> list[StreamDelta]:
        """Each completion's last delta, from the request's output: the rest of its text,
        tokens and logprobs, and why it finished."""
        deltas = []
        for done in output.outputs:
            i = done.index
            tokens, chars = self._sent_tokens[i], self._sent_chars[i]
            logprobs = None if done.logprobs is None else done.logprobs[tokens:]
            delta = StreamDelta(
                done.text[chars:],
                done.token_ids[tokens:],
                i,
                finish_reason=done.finish_reason,
                stop_reason=done.stop_reason,
                logprobs=logprobs,
                prompt_logprobs=self._prompt_logprobs(i, output),
            )
            deltas.append(delta)
        return deltas

    def _prompt_logprobs(self, index: int, output: RequestOutput | None) -> PromptLogprobs | None:
        """The prompt's logprobs, for completion 0's first delta (None for the others)."""
        if index or self._prompt_logprobs_sent:
            return None
        self._prompt_logprobs_sent = True
        if output is not None:
            return output.prompt_logprobs
        return self._request.prompt_logprobs(self._token_texts)
