"""Turn one sequence's sampled tokens into streamed `GenerationOutput` pieces.

Per token: stop token ids (EOS unless ignore_eos, and the request's own) end the sequence and are
not detokenized (with logprobs, every token is also named by its own text, stop tokens included:
`Tokenizer.token_texts`); any other token goes through the incremental detokenizer (never half a UTF-8
character) and the stop-string matcher (which holds back a tail that may begin a stop string, and
cuts the text before a matched stop string). max_tokens ends it with LENGTH. The last piece carries
whatever text was still held and the finish reason.

A request with n > 1 completions has n OutputStreams sharing one `RequestStreams` (its sink and its
count of unfinished completions); each piece carries its completion's `index`. The usage goes on the
last piece of the request, once all n finished: the prompt counted once, the completion tokens summed.
For n = 1 that is the one finishing piece, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpact.worker.engine.request import FinishReason, GenerationOutput, PromptEcho, TopLogprobs, Usage
from kvpact.worker.engine.sequence import Sequence
from kvpact.worker.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

Sink = Callable[[GenerationOutput | BaseException], None]


class RequestStreams:
    """The OutputStreams of one request, in index order, and what they share."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.streams: list[OutputStream] = []
        self.num_unfinished = 0

    @property
    def request_id(self) -> str:
        return self.streams[0].seq.request_id

    def usage(self) -> Usage:
        first = self.streams[0].seq
        completion = sum(s.seq.num_output_tokens for s in self.streams)
        return Usage(first.num_prompt_tokens, completion, first.num_cached_tokens)

    def fail(self, error: BaseException) -> None:
        self.sink(error)


class OutputStream:
    def __init__(
        self,
        seq: Sequence,
        tokenizer: Tokenizer,
        stop: tuple[str, ...],
        sink: Sink | RequestStreams,
        echo: PromptEcho | None = None,
    ) -> None:
        """`sink`: the request's (n = 1), or the RequestStreams this stream joins (in index order).
        `echo`: the prompt its first piece carries (GenerationRequest.echo), the logprobs added then."""
        self.seq = seq
        self._echo = echo
        self.request = sink if isinstance(sink, RequestStreams) else RequestStreams(sink)
        self.request.streams.append(self)
        self.request.num_unfinished += 1
        self.sink = self.request.sink
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids[: seq.num_prompt_tokens])
        self._stop = StopMatcher(stop)
        # time.monotonic() seconds, for the engine's observer (queue time, TTFT, inter-token latency)
        self.arrival_s = time.monotonic()
        self.scheduled_s: float | None = None
        self.last_token_s: float | None = None

    def on_token(
        self, token_id: int, logprob: float | None, top_logprobs: TopLogprobs | None = None
    ) -> GenerationOutput:
        """Append a sampled token and return its piece (not yet emitted). A piece with a finish_reason
        ended the sequence: the caller frees its cache first, then emits it, so a caller that sees the
        last piece also sees the cache freed."""
        seq = self.seq
        seq.append_token(token_id, logprob)
        reason = seq.check_stop_token()
        text = ""
        if not seq.ended_on_stop_token:
            text, matched = self._stop.feed(self._detokenizer.add(token_id))
            if matched is not None:
                reason = FinishReason.STOP
        if reason is not None:
            text += self._tail()
        if top_logprobs is not None:
            top_logprobs.tokens = self._tokenizer.token_texts(top_logprobs.token_ids)
        return GenerationOutput(
            request_id=seq.request_id,
            prompt=self._echoed() if self._echo is not None and seq.num_output_tokens == 1 else None,
            text=text,
            token_ids=[token_id],
            logprobs=[logprob] if logprob is not None else [],
            finish_reason=reason,
            usage=self._finish(reason) if reason is not None else None,
            top_logprobs=[top_logprobs] if top_logprobs is not None else [],
            index=seq.index,
            tokens=self._tokenizer.token_texts([token_id]) if logprob is not None else [],
        )

    def _echoed(self) -> PromptEcho:
        """The prompt with its logprobs (a paged fork shares the ones its first completion computed)."""
        assert self._echo is not None
        computed = self.seq
        top = [
            TopLogprobs(t.token_ids, t.logprobs, self._tokenizer.token_texts(t.token_ids))
            for t in computed.prompt_top_logprobs
        ]
        return PromptEcho(
            self._echo.text, self._echo.token_ids, self._echo.tokens, list(computed.prompt_logprobs), top
        )

    def finish_early(self, reason: FinishReason) -> None:
        """End a sequence that did not end on a token (aborted): emit the held text (and the usage if it
        was the request's last)."""
        tail = self._tail()
        usage = self._finish(reason)
        self.sink(GenerationOutput(self.seq.request_id, tail, [], [], reason, usage, index=self.seq.index))

    def fail(self, error: BaseException) -> None:
        self.sink(error)

    def usage(self) -> Usage:
        """The request's usage so far (all its completions)."""
        return self.request.usage()

    def _finish(self, reason: FinishReason) -> Usage | None:
        """Mark this completion finished; the request's usage if it was the last one, else None."""
        self.seq.finish_reason = reason
        self.request.num_unfinished -= 1
        return self.request.usage() if self.request.num_unfinished == 0 else None

    def _tail(self) -> str:
        """Text still held back, unless a stop string already cut the output."""
        if self._stop.matched is not None:
            return ""
        text, matched = self._stop.feed(self._detokenizer.flush())
        return text if matched is not None else text + self._stop.flush()
