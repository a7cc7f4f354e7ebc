"""Pick the next token of every sequence in a step from its logits row.

Order, per row (the same as Hugging Face's logits processors): repetition penalty -> presence and
frequency penalties (OpenAI's, over the generated tokens) -> logit bias (OpenAI's) -> masks (the stop
tokens before min_tokens, a grammar's allowed tokens) -> greedy argmax (temperature 0) or temperature
-> top-k -> top-p -> min-p -> one draw. Each stage runs only on the rows that use it, as one batched
op: a batch that uses none pays one pass over the rows' `processed` flags (what the repetition
penalty's own check cost before).
The filters run vectorized over the batch; only the draw is per row, because a seeded request draws
from its own torch.Generator so that its tokens depend on (seed, prompt) alone, never on what else is
in the batch. Unseeded rows share one batched draw from the global generator.

The logprob reported for a sampled token, and the top_logprobs alternatives, are log_softmax of the
model's raw logits (before penalties, masks, temperature and filters): the model's own belief.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvpact.worker.engine.accelerator import to_device
from kvpact.worker.engine.request import SamplingParams, TopLogprobs

if TYPE_CHECKING:
    from kvpact.worker.engine.grammar import GrammarState


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs of one sequence: its params, its generator (seeded requests only), the
    token ids the repetition penalty looks at (prompt + generated; the presence and frequency penalties
    look at `token_ids[num_prompt_tokens:]`), the token ids it may not sample now (its stop tokens
    while min_tokens is not reached) and its grammar (response_format), if any."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: Seq[int]
    num_prompt_tokens: int = 0
    masked_token_ids: Collection[int] = ()
    grammar: GrammarState | None = None
    processed: bool = field(init=False)  # a penalty, a mask or a grammar applies: the processors look

    def __post_init__(self) -> None:
        p = self.params
        self.processed = bool(
            p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or p.logit_bias
            or self.masked_token_ids
            or self.grammar is not None
        )


class Sampled(NamedTuple):
    """Per row: the sampled token, its logprob (None unless asked) and its alternatives (None unless
    top_logprobs > 0)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs | None]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, rows: Seq[SampleRow]) -> Sampled:
    """logits: [num_rows, vocab] fp32, one row per entry of `rows`. Returns the sampled token ids and,
    per row, the sampled token's logprob and alternatives (None where the row did not ask)."""
    num_rows = logits.shape[0]
    assert num_rows == len(rows), f"{num_rows} logits rows for {len(rows)} sequences"
    want_logprobs = [r.params.logprobs for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    processed = [i for i, r in enumerate(rows) if r.processed]  # the one pass a plain batch pays
    if processed:
        logits = _apply_repetition_penalty(logits, rows, processed)
        logits = _apply_output_penalties(logits, rows, processed)
        logits = _apply_logit_bias(logits, rows, processed)
        logits = _apply_masks(logits, rows, processed)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    token_ids = _argmax(logits)  # every row greedy is the common case; sampled rows are overwritten
    if sampled:
        idx = _indices(sampled, logits.device)
        token_ids[idx] = _sample_rows(logits[idx], [rows[i] for i in sampled])

    ids = token_ids.tolist()  # the step's one device sync
    logprobs: list[float | None] = [None] * num_rows
    top: list[TopLogprobs | None] = [None] * num_rows
    if raw_logprobs is not None:
        picked = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
        logprobs = [lp if want else None for lp, want in zip(picked, want_logprobs, strict=True)]
        top = _top_logprobs(raw_logprobs, rows)
    return Sampled(ids, logprobs, top)


def _apply_output_penalties(logits: torch.Tensor, rows: Seq[SampleRow], among: list[int]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: logit -= frequency * count + presence * (count > 0),
    where count is how often the token occurs in the generated tokens (not the prompt)."""
    penalized = [i for i in among if rows[i].params.presence_penalty or rows[i].params.frequency_penalty]
    if not penalized:
        return logits
    device = logits.device
    outputs = [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in penalized]
    counts = torch.zeros(len(penalized), logits.shape[1], dtype=logits.dtype, device=device)
    out_rows = torch.cat([torch.full((len(o),), j, dtype=torch.long) for j, o in enumerate(outputs)])
    out_ids = torch.cat([torch.as_tensor(list(o), dtype=torch.long) for o in outputs])
    if len(out_ids):
        ones = torch.ones(len(out_ids), dtype=logits.dtype, device=device)
        counts.index_put_((to_device(out_rows, device), to_device(out_ids, device)), ones, accumulate=True)
    frequency = _values([rows[i].params.frequency_penalty for i in penalized], device)[:, None]
    presence = _values([rows[i].params.presence_penalty for i in penalized], device)[:, None]
    idx = _indices(penalized, device)
    logits = logits.clone()
    logits[idx] = logits[idx] - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: Seq[SampleRow], among: list[int]) -> torch.Tensor:
    """OpenAI's logit_bias: each named token's bias added to its logit (one indexed add for the batch)."""
    biased = [i for i in among if rows[i].params.logit_bias]
    if not biased:
        return logits
    device = logits.device
    row_ids = [i for i in biased for _ in rows[i].params.logit_bias]
    token_ids = [t for i in biased for t in rows[i].params.logit_bias]
    biases = [b for i in biased for b in rows[i].params.logit_bias.values()]
    logits = logits.clone()
    index = (_indices(row_ids, device), _indices(token_ids, device))
    logits.index_put_(index, _values(biases, device).to(logits.dtype), accumulate=True)
    return logits


def _apply_masks(logits: torch.Tensor, rows: Seq[SampleRow], among: list[int]) -> torch.Tensor:
    """-inf for the tokens a row may not sample: its stop tokens before min_tokens, and whatever its
    grammar does not allow next (one bitmask for the batch's grammar rows)."""
    masked = [i for i in among if rows[i].masked_token_ids]
    constrained = [i for i in among if rows[i].grammar is not None]
    if not masked and not constrained:
        return logits
    logits = logits.clone()
    device = logits.device
    if masked:
        ids = [list(rows[i].masked_token_ids) for i in masked]
        row_ids = torch.cat(
            [torch.full((len(t),), i, dtype=torch.long) for i, t in zip(masked, ids, strict=True)]
        )
        token_ids = torch.tensor([t for row in ids for t in row], dtype=torch.long)
        logits[to_device(row_ids, device), to_device(token_ids, device)] = float("-inf")
    if constrained:
        from kvpact.worker.engine.grammar import apply_grammars  # xgrammar loads only once a grammar is used

        idx = _indices(constrained, device)
        sub = logits[idx]
        apply_grammars(sub, [g for i in constrained if (g := rows[i].grammar) is not None])
        logits[idx] = sub
    return logits


def _top_logprobs(raw_logprobs: torch.Tensor, rows: Seq[SampleRow]) -> list[TopLogprobs | None]:
    """The rows' top_logprobs most likely tokens (one batched topk at the largest k asked)."""
    top: list[TopLogprobs | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.params.top_logprobs]
    if not wanted:
        return top
    k = min(max(rows[i].params.top_logprobs for i in wanted), raw_logprobs.shape[1])
    values, ids = raw_logprobs[_indices(wanted, raw_logprobs.device)].topk(k, dim=-1)
    for i, row_values, row_ids in zip(wanted, values.tolist(), ids.tolist(), strict=True):
        n = rows[i].params.top_logprobs
        top[i] = TopLogprobs(token_ids=row_ids[:n], logprobs=row_values[:n])
    return top


def _apply_repetition_penalty(logits: torch.Tensor, rows: Seq[SampleRow], among: list[int]) -> torch.Tensor:
    """Every token already in the sequence: a positive logit is divided by the penalty, a negative one
    multiplied (so penalty > 1 always makes it less likely)."""
    penalized = [i for i in among if rows[i].params.repetition_penalty != 1.0]
    if not penalized:
        return logits
    logits = logits.clone()
    device = logits.device
    seen_rows = torch.cat([torch.full((len(rows[i].token_ids),), j) for j, i in enumerate(penalized)])
    seen_ids = torch.cat([torch.as_tensor(rows[i].token_ids, dtype=torch.long) for i in penalized])
    seen = torch.zeros(len(penalized), logits.shape[1], dtype=torch.bool)
    seen[seen_rows, seen_ids] = True
    seen = to_device(seen, device)
    penalty = _values([rows[i].params.repetition_penalty for i in penalized], device)[:, None]
    idx = _indices(penalized, device)
    sub = logits[idx]
    sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    logits[idx] = sub
    return logits


def _sample_rows(logits: torch.Tensor, rows: Seq[SampleRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p over [n, vocab] logits, then one draw per row."""
    device = logits.device
    n, vocab = logits.shape
    temperature = _values([r.params.temperature for r in rows], device)[:, None]
    # Softmax is unchanged by shifting a row so its best logit is 0; then a tiny temperature sends the rest
    # towards -inf (its greedy limit) instead of overflowing them to +inf, where softmax gives nan. The
    # clamp first turns a tiny repetition penalty's +inf into the largest finite logit.
    finite = torch.finfo(logits.dtype)
    logits = logits.clamp(finite.min, finite.max)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    # Work in descending order: top-k and top-p are prefixes of it, and min-p keeps a prefix too.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    top_k = _indices([r.params.top_k or vocab for r in rows], device)[:, None]
    remove = rank >= top_k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    top_p = _values([r.params.top_p for r in rows], device)[:, None]
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
    remove |= mass_before >= top_p
    min_p = _values([r.params.min_p for r in rows], device)[:, None]
    remove |= probs < min_p * probs[:, :1]
    remove[:, 0] = False  # the most likely token always survives
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)

    choice = torch.empty(n, dtype=torch.long, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        idx = _indices(unseeded, device)
        choice[idx] = torch.multinomial(probs[idx], 1).squeeze(1)
    for i, r in enumerate(rows):
        if r.generator is not None:
            choice[i] = torch.multinomial(probs[i], 1, generator=r.generator)[0]
    return sorted_ids.gather(1, choice[:, None]).squeeze(1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (a NaN counts as the largest, as in torch's argmax). A float32 CPU
    tensor goes through numpy's argmax: torch's CPU argmax took 43 us on one 49,152-wide row (the bundled
    model's vocabulary) and 665 us on 32, numpy's 5 and 103, about 1% of a decode step either way."""
    plain = logits.dim() == 2 and not logits.requires_grad and not logits.is_neg()  # what .numpy() takes
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and plain:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _indices(values: Seq[int], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.long), device)


def _values(values: Seq[float], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.float32), device)
