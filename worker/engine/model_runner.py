"""Run one scheduled step on the model: flatten the chunks, forward, sample.

The flat batch puts the one-token chunks (decodes) first, then the longer chunks, so each cache's
AttentionStep sees `num_decodes` decode rows followed by prefill/extend rows. Logits are computed only
for the last token of chunks that reach their sequence's end (a middle chunk of a long prompt samples
nothing), and for the prompt tokens of a sequence whose prompt's logprobs were asked for
(`_record_prompt_logprobs`).

`device` is where the step's inputs go: the first stage's (worker/model/stages.py); the sampled rows are
read on the device the hidden states come back on.

On CUDA a step synchronizes with the device once, when the sampler reads the token ids back: every
host tensor goes over with `startup.device.to_device` (no stream sync), and the caches' AttentionSteps
keep their metadata on the host side too.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpact.worker.engine.accelerator import to_device
from kvpact.worker.engine.request import TopLogprobs
from kvpact.worker.engine.sampling import sample
from kvpact.worker.engine.sequence import ScheduledChunk, Sequence
from kvpact.worker.kv import KVCache
from kvpact.worker.kv.paged import PagedCache
from kvpact.worker.model import LlamaForCausalLM

if TYPE_CHECKING:
    from kvpact.worker.engine.decode_graphs import DecodeGraphs
    from kvpact.worker.engine.fused_decode import FusedDecode
    from kvpact.worker.parallel.ranks import RankGroup


PROMPT_LOGITS_ROWS = 256  # prompt positions whose logits over the vocabulary are held at once


@dataclass(slots=True)
class StepResult:
    """The sequences that sampled this step, with their token, logprob and alternatives (None unless
    asked for)."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]
    logits: torch.Tensor | None = None  # [len(seqs), vocab] fp32, kept only when `keep_logits`


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.keep_logits = False  # tests compare per-step logits with a reference
        self.ranks: RankGroup | None = None  # --tensor-parallel-size > 1: this is rank 0, leading the rest
        self.graphs: DecodeGraphs | None = None  # --cuda-graphs realized: decode steps replay
        self.fused: FusedDecode | None = None  # C kernels: small decode steps' layers in one C call

    def kernel_compiles_after_ready(self) -> int:
        """Triton kernel variants compiled since the startup warm-up (0 without Triton kernels)."""
        return self.cache.kernel_compiles_after_ready() if isinstance(self.cache, PagedCache) else 0

    def eager_steps_under_graphs(self) -> int:
        """Decode-only steps that ran eagerly although CUDA graphs were captured (0 without them)."""
        return self.graphs.eager_steps if self.graphs is not None else 0

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepResult:
        decodes = [c for c in chunks if c.num_tokens == 1]
        ordered = decodes + [c for c in chunks if c.num_tokens != 1]
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        block_copies: list[tuple[int, int]] = []
        first_rows: list[int] = []  # each chunk's first row in the flat batch
        for c in ordered:
            first_rows.append(len(input_ids))
            if c.block_copies:
                block_copies += c.block_copies
            input_ids += c.seq.token_ids[c.start : c.end]
            positions += range(c.start, c.end)
            if c.samples:
                sample_rows += [len(input_ids) - 1] * (1 + len(c.forks))  # forks: the same logits
        if block_copies:  # copy on write (paged, n > 1): before this step writes into the copies
            assert isinstance(self.cache, PagedCache), "block copies on a cache without blocks"
            self.cache.copy_blocks(block_copies)
        if self.graphs is not None and self.graphs.fits(ordered, len(decodes)):
            hidden = self.graphs.run(ordered)  # a captured decode step, replayed
        else:
            hidden = self._forward(ordered, len(decodes), input_ids, positions, block_copies)
        for c, first in zip(ordered, first_rows, strict=True):
            if c.seq.needs_prompt_logprobs:
                self._record_prompt_logprobs(c, hidden[first : first + c.num_tokens])
        seqs = [s for c in ordered if c.samples for s in (c.seq, *c.forks)]
        if not seqs:
            return StepResult([], [], [], [])
        rows = hidden.shape[0]
        if len(sample_rows) != rows or sample_rows != list(range(rows)):  # else every row in order (decodes)
            hidden = hidden[to_device(torch.tensor(sample_rows, dtype=torch.long), hidden.device)]
        logits = self.model.compute_logits(hidden)
        sampled = sample(logits, [s.sample_row() for s in seqs])
        kept = logits if self.keep_logits else None
        return StepResult(seqs, sampled.token_ids, sampled.logprobs, sampled.top_logprobs, kept)

    def _record_prompt_logprobs(self, c: ScheduledChunk, hidden: torch.Tensor) -> None:
        """The chunk's share of its prompt's logprobs: its row for position p predicts token p + 1,
        recorded where p + 1 is a prompt token not recorded yet (a prompt recomputed after a preemption
        records nothing twice). The logits over the vocabulary go PROMPT_LOGITS_ROWS rows at a time."""
        seq = c.seq
        k = seq.sampling.prompt_logprobs or 0
        end = min(c.end, seq.num_prompt_tokens - 1)
        for lo in range(max(c.start, len(seq.prompt_logprobs)), end, PROMPT_LOGITS_ROWS):
            hi = min(lo + PROMPT_LOGITS_ROWS, end)
            logprobs = torch.log_softmax(
                self.model.compute_logits(hidden[lo - c.start : hi - c.start]), dim=-1
            )
            targets = torch.tensor(seq.token_ids[lo + 1 : hi + 1], dtype=torch.long, device=logprobs.device)
            seq.prompt_logprobs += logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            if k:
                values, ids = logprobs.topk(k, dim=-1)
                seq.prompt_top_logprobs += [
                    TopLogprobs(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                ]

    def _forward(
        self,
        ordered: list[ScheduledChunk],
        num_decodes: int,
        input_ids: list[int],
        positions: list[int],
        block_copies: list[tuple[int, int]],
    ) -> torch.Tensor:
        """The eager forward of a step: its final hidden states."""
        ids = to_device(torch.tensor(input_ids, dtype=torch.long), self.device)
        pos = to_device(torch.tensor(positions, dtype=torch.long), self.device)
        attn = self.cache.attention_step(ordered, num_decodes)
        if self.fused is not None and (hidden := self.fused.run(ids, pos, attn)) is not None:
            return hidden
        # Tensor parallel: the other ranks run the same forward on their shards (worker/parallel/).
        # With a paged cache, rank 0's block tables drive every rank's pool.
        lead = (
            self.ranks.lead(
                input_ids,
                ordered,
                num_decodes,
                paged=isinstance(self.cache, PagedCache),
                block_copies=block_copies,
            )  # fmt: skip
            if self.ranks
            else nullcontext()
        )
        with lead:
            return self.model(ids, pos, attn)  # on the last stage's device (a --device-map's last entry)
