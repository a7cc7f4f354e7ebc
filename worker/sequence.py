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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvpact.worker.block_manager import BlockTable
from kvpact.worker.request import FinishReason, SamplingParams
from kvpact.worker.sampling import SampleRow, make_generator


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
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    num_admissions: int = 0
    slot: int | None = None  # EAGER
    block_table: BlockTable = field(default_factory=lambda: BlockTable(block_ids=[]))  # PAGED
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

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
    ) -> Sequence:
        return cls(
            seq_id=seq_id,
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            generator=make_generator(sampling.seed, device),
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
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sample_row(self) -> SampleRow:
        return SampleRow(params=self.sampling, generator=self.generator, token_ids=self.token_ids)

    def append_token(self, token_id: int, logprob: float | None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def check_stop_token(self) -> FinishReason | None:
        """Finish reason after the last appended token (stop strings are checked on text, elsewhere)."""
        if self.token_ids[-1] in self.stop_token_ids:
            return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step: compute `token_ids[start : start + num_tokens]`, where
    start = `seq.num_computed_tokens` when scheduled. A chunk that reaches the sequence's last token
    also samples its next token."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens
