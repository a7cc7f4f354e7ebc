"""Turn one sequence's sampled tokens into streamed `GenerationOutput` pieces.

Per token: stop token ids (EOS unless ignore_eos, and the request's own) end the sequence and are
not detokenized; any other token goes through the incremental detokenizer (never half a UTF-8
character) and the stop-string matcher (which holds back a tail that may begin a stop string, and
cuts the text before a matched stop string). max_tokens ends it with LENGTH. The last piece carries
whatever text was still held, the finish reason and the usage.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpact.worker.request import FinishReason, GenerationOutput, TopLogprobs, Usage
from kvpact.worker.sequence import Sequence
from kvpact.worker.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

Sink = Callable[[GenerationOutput | BaseException], None]


class OutputStream:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer, stop: tuple[str, ...], sink: Sink) -> None:
        self.seq = seq
        self.sink = sink
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
            seq.finish_reason = reason
        return GenerationOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=[token_id],
            logprobs=[logprob] if logprob is not None else [],
            finish_reason=reason,
            usage=self.usage() if reason is not None else None,
            top_logprobs=[top_logprobs] if top_logprobs is not None else [],
        )

    def finish_early(self, reason: FinishReason) -> None:
        """End a sequence that did not end on a token (aborted): emit the held text and the usage."""
        self.seq.finish_reason = reason
        self.sink(GenerationOutput(self.seq.request_id, self._tail(), [], [], reason, self.usage()))

    def fail(self, error: BaseException) -> None:
        self.sink(error)

    def usage(self) -> Usage:
        seq = self.seq
        return Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens)

    def _tail(self) -> str:
        """Text still held back, unless a stop string already cut the output."""
        if self._stop.matched is not None:
            return ""
        text, matched = self._stop.feed(self._detokenizer.flush())
        return text if matched is not None else text + self._stop.flush()
