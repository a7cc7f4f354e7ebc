"""Grammar-constrained decoding for `response_format` (JSON, or JSON matching a schema), with xgrammar.

    GrammarCompiler   one per engine, built on first use from the engine's tokenizer (xgrammar reads
                      the vocabulary through a transformers fast tokenizer wrapped around ours) and the
                      model's vocab size (the logits' width). `compile` turns a ResponseFormat into an
                      xgrammar CompiledGrammar; xgrammar's compiler caches them by schema, so one schema
                      compiles once per worker. It runs in the engine's prepare thread (before admission),
                      never in the step thread.
    GrammarState      one per sequence: the matcher, advanced on every token the sequence appends;
                      `is_terminated()` once the grammar reached its end (the stop token it allowed).
    apply_grammars    one step's constrained rows: fill one token bitmask, apply it to their logits
                      (-inf where the grammar forbids the token).

Invariant: a sequence's matcher has accepted exactly its generated tokens; since the sampler only draws
allowed tokens, `accept` never refuses one (if it did, the request fails with that message).
This module imports xgrammar (and transformers): the engine and the sampler import it only once a
request asks for a response_format.
"""

from __future__ import annotations

import json
import re
import threading

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from kvpact.shared.errors import RequestError
from kvpact.worker.engine.accelerator import to_device
from kvpact.worker.engine.request import GenerationError, ResponseFormat
from kvpact.worker.tokenizer import Tokenizer

_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: \(error\.empty\(\)\) is false: )?")


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._lock = threading.Lock()  # the engine's prepare threads share one compiler

    def compile(self, response_format: ResponseFormat) -> xgr.CompiledGrammar:
        """RequestError naming response_format.json_schema when the schema is not JSON or not one
        xgrammar can compile."""
        schema = response_format.json_schema
        with self._lock:
            if schema is None:
                return self._compiler.compile_builtin_json_grammar()
            try:
                json.loads(schema)
            except ValueError as e:
                raise RequestError(f"response_format.json_schema is not valid JSON: {e}") from e
            try:
                return self._compiler.compile_json_schema(schema, any_whitespace=False)
            except (RuntimeError, ValueError, TypeError) as e:
                reason = _NATIVE_PREFIX.sub("", str(e).strip()).splitlines()[0]
                raise RequestError(
                    f"response_format.json_schema is not a JSON Schema this worker can enforce: {reason}"
                ) from e


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise GenerationError(f"the grammar (response_format) refused sampled token {token_id}")

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def apply_grammars(logits: torch.Tensor, states: list[GrammarState]) -> None:
    """logits: [len(states), vocab], changed in place: what each row's grammar forbids next is -inf."""
    bitmask = xgr.allocate_token_bitmask(len(states), logits.shape[1])
    for i, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, to_device(bitmask, logits.device), vocab_size=logits.shape[1])
