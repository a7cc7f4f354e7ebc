"""Incremental detokenization, one per sequence: token ids in, text pieces out, never half a character.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is often 2-4 tokens).
Decoding such a prefix yields U+FFFD, so text ending in U+FFFD is held back until the next token
completes the character. Only a short window of ids is decoded each step:

    ids:  ... [prefix_offset ........ read_offset ........ len(ids)]
               \\__ already emitted __/ \\___ new, not yet emitted ___/

    emitted piece = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Decoding from `prefix_offset` rather than from `read_offset` keeps the tokenizer's context (a
SentencePiece decoder strips the leading space of the first token it sees; bytes of a character
split across the boundary are decoded together).
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

from kvpact.worker.tokenizer.tokenizer import Tokenizer

# Prompt tokens kept as decoding context for the first generated tokens.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """`add(token_id)` -> the new text that is safe to show (often "", never a split character);
    `flush()` at the end releases anything still held (an incomplete character shows as U+FFFD)."""

    __slots__ = ("_decode", "_ids", "_prefix_offset", "_read_offset", "_skip_special")

    def __init__(
        self,
        tokenizer: Tokenizer | tokenizers.Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
        self._decode = backend.decode
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Everything not yet emitted, even an incomplete character (as U+FFFD). Call once, at the end."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        ids, start, read = self._ids, self._prefix_offset, self._read_offset
        before = self._decode(ids[start:read], skip_special_tokens=self._skip_special) if read > start else ""
        after = self._decode(ids[start:], skip_special_tokens=self._skip_special)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = read, len(ids)
        if start:  # drop ids no window will read again
            del ids[:start]
            self._prefix_offset -= start
            self._read_offset -= start
        return after[len(before) :]
