"""Tokenization for serving: the `Tokenizer` (encode/decode, chat template), and the two per-sequence
helpers the step loop uses on generated text — `IncrementalDetokenizer` (never splits a UTF-8
character) and `StopMatcher` (stop strings across token boundaries). `tiny` builds the tiny tokenizer
tests and benchmarks share; nothing serves with it."""

from kvpact.worker.tokenizer.chat_template import ChatTemplate
from kvpact.worker.tokenizer.detokenizer import IncrementalDetokenizer
from kvpact.worker.tokenizer.stop import StopMatcher
from kvpact.worker.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopMatcher", "Tokenizer"]
