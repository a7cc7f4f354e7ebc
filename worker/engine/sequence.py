"""One request's life inside the engine, and one step's slice of it.

Invariants of a `Sequence`:
  - `token_ids` = prompt + generated tokens; it only grows (one append per sampled token).
  - while RUNNING, the K/V of `token_ids[:num_computed_tokens]` are in the sequence's cache (its slot
    or its block table) and `num_computed_tokens <= len(token_ids)`; a step that computes the last
    token samples the next one, so a running sequence has exactly one uncomputed token between steps
    once its prompt is done.
  - while WAITING it holds no cache: `num_computed_tokens == 0`, `slot is None`, no blocks. A preempted
    sequence goes back to WAITING with its generated tokens kept; they are recomputed as part of
    its prompt when it is admitted again.
  - FINISHED is final; the scheduler has released its cache.
  - n > 1 completions of one request are n sequences with `index` 0..n-1. On a paged worker the others
    wait in `pending_forks` of index 0 (in no queue, holding nothing) until its prompt is computed;
    then they fork its blocks and sample their first token from the same logits (`ScheduledChunk.forks`),
    and from there on are ordinary sequences.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpact.worker.engine.request import FinishReason, SamplingParams, TopLogprobs
from kvpact.worker.engine.sampling import SampleRow, make_generator
from kvpact.worker.scheduler.block_manager import BlockTable

if TYPE_CHECKING:
    from kvpact.worker.engine.grammar import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    max_tokens: int  # generated tokens allowed (prompt + max_tokens <= max_model_len)
    stop_token_ids: frozenset[int]  # includes EOS unless ignore_eos
    generator: torch.Generator | None = None
    min_tokens: int = 0  # the stop tokens are masked until this many tokens were generated
    grammar: GrammarState | None = None  # response_format: advanced on every appended token
    index: int = 0  # which of the request's n completions
    pending_forks: list[Sequence] = field(default_factory=list)  # PAGED, index 0 before its first token
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    num_admissions: int = 0
    slot: int | None = None  # EAGER
    block_table: BlockTable = field(default_factory=lambda: BlockTable(block_ids=[]))  # PAGED
    logprobs: list[float] = field(default_factory=list)
    # sampling.prompt_logprobs: token p + 1's logprob given the prompt up to p, for p = 0 .. prompt - 2
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    _row: SampleRow | None = field(default=None, repr=False)  # sample_row's, built while _row_early
    _row_early: bool = field(default=False, repr=False)

    @classmethod
    def create(
        cls,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop_token_ids: frozenset[int],
        device: torch.device,
        min_tokens: int = 0,
        grammar: GrammarState | None = None,
        index: int = 0,
    ) -> Sequence:
        """Completion `index` of a seeded request draws from seed + index (mod 2**64): each of the n
        completions differs, and each is reproducible."""
        seed = None if sampling.seed is None else (sampling.seed + index) % 2**64
        return cls(
            seq_id=seq_id,
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            generator=make_generator(seed, device),
            min_tokens=min_tokens,
            grammar=grammar,
            index=index,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs were asked for and are not all computed: its prompt must be computed
        from its first token (no cached prefix), and the steps that compute it record them."""
        return (
            self.sampling.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sample_row(self) -> SampleRow:
        """Built once and kept (it holds `token_ids` itself, which grows in place); rebuilt only when
        min_tokens is reached and the stop tokens stop being masked."""
        early = len(self.token_ids) - self.num_prompt_tokens < self.min_tokens
        row = self._row
        if row is None or self._row_early != early:
            self._row_early = early
            row = self._row = SampleRow(
                params=self.sampling,
                generator=self.generator,
                token_ids=self.token_ids,
                num_prompt_tokens=self.num_prompt_tokens,
                masked_token_ids=self.stop_token_ids if early else (),
                grammar=self.grammar,
            )
        return row

    def append_token(self, token_id: int, logprob: float | None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    @property
    def ended_on_stop_token(self) -> bool:
        """The last token ended the output as a stop token (a stop id, or the end its grammar allowed):
        it is not part of the text."""
        grammar_done = self.grammar is not None and self.grammar.is_terminated()
        return self.token_ids[-1] in self.stop_token_ids or grammar_done

    def check_stop_token(self) -> FinishReason | None:
        """Finish reason after the last appended token (stop strings are checked on text, elsewhere)."""
        if self.ended_on_stop_token:
            return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step: compute `token_ids[start : start + num_tokens]`, where
    start = `seq.num_computed_tokens` when scheduled. A chunk that reaches the sequence's last token
    also samples its next token, and so does each of `forks` (sequences that share its blocks from this
    step on, n > 1) from the same logits. `block_copies`: (src, dst) KV blocks the cache copies before
    the step writes (copy on write of a block shared with a fork)."""

    seq: Sequence
    start: int
    num_tokens: int
    forks: tuple[Sequence, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens
