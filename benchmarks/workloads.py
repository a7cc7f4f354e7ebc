"""Seeded, reproducible request workloads, cut from a corpus shipped in the repository.

The corpus (benchmarks/corpus/kvpact_docs.smollm2.json) is kvpact's own README and docs, tokenized
once by SmolLM2-135M-Instruct's tokenizer (19,965 token ids). A prompt is a slice of it at a seeded
offset (wrapping around); for a model with a smaller vocabulary (the test's tiny model) every id is
folded `% vocab_size`, so the same seed gives the same shapes on any model. Every request is greedy
with `ignore_eos`, so every system under test generates exactly `max_tokens` tokens.

Distributions (uniform integers, both ends included; `Random(seed)`):

    mixed          prompt 32-256 tokens, output 16-256
    long_prompt    prompt 512-1,536, output 16-128
    fixed          every prompt and every output of one given length (what guidellm sends)
    shared_prefix  one common 768-token system prompt, then a 32-128 token question; output 16-128
    text_items     text prompts (corpus windows decoded by a tokenizer.json) of one length, outputs
                   spread around one length (the two clients of benchmarks/client_agreement.py)

`fit(items, max_model_len)` shortens prompts and outputs proportionally so prompt + output fits a
smaller model (the tiny test model), and `with_poisson_arrivals` adds exponential gaps for online runs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus" / "kvpact_docs.smollm2.json"
SHARED_PREFIX_TOKENS = 768


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request: prompt token ids, tokens to generate (ignore_eos), and its arrival offset in
    seconds from the start of the run (0 for offline workloads)."""

    prompt: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TextItem:
    """One request with a text prompt (what an OpenAI client sends): `prompt_tokens` is its length by
    the model's tokenizer."""

    prompt: str
    prompt_tokens: int
    max_tokens: int


def text_items(
    tokenizer_json: Path, n: int, seed: int, lengths_seed: int, prompt_tokens: int, output_tokens: int
) -> list[TextItem]:
    """`n` text prompts: corpus windows of `prompt_tokens` tokens (offsets drawn with `seed`) decoded by
    the tokenizer, cut so they re-tokenize to at most that many; outputs drawn uniformly from
    [output_tokens / 2, 3 * output_tokens / 2] with `lengths_seed`, so runs that share it ask for the same
    lengths in the same order while their prompts differ (the prefix cache helps none of them)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokens = corpus()
    offsets, lengths = random.Random(seed), random.Random(lengths_seed)
    items = []
    for _ in range(n):
        window = _slice(tokens, offsets.randrange(len(tokens)), prompt_tokens, tokenizer.get_vocab_size())
        text = tokenizer.decode(list(window))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        for cut in range(prompt_tokens, 0, -1):  # decode(encode(text)) may re-tokenize longer: cut it
            if len(ids) <= prompt_tokens:
                break
            text = tokenizer.decode(ids[:cut])
            ids = tokenizer.encode(text, add_special_tokens=False).ids
        out = lengths.randint(max(1, output_tokens // 2), output_tokens * 3 // 2)
        items.append(TextItem(text, len(ids), out))
    return items


def corpus() -> list[int]:
    return list(json.loads(CORPUS.read_text())["tokens"])


def _slice(tokens: list[int], start: int, length: int, vocab_size: int) -> tuple[int, ...]:
    n = len(tokens)
    return tuple(tokens[(start + i) % n] % vocab_size for i in range(length))


def _draw(
    n: int, seed: int, vocab_size: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> list[WorkItem]:
    rng = random.Random(seed)
    tokens = corpus()
    items = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        out = rng.randint(*output_range)
        items.append(WorkItem(_slice(tokens, rng.randrange(len(tokens)), length, vocab_size), out))
    return items


def mixed(n: int, seed: int, vocab_size: int) -> list[WorkItem]:
    return _draw(n, seed, vocab_size, (32, 256), (16, 256))


def fixed(n: int, seed: int, vocab_size: int, prompt_tokens: int, output_tokens: int) -> list[WorkItem]:
    """Every prompt `prompt_tokens` long, every output `output_tokens` (a benchmark client's shape)."""
    return _draw(n, seed, vocab_size, (prompt_tokens, prompt_tokens), (output_tokens, output_tokens))


def long_prompt(n: int, seed: int, vocab_size: int) -> list[WorkItem]:
    return _draw(n, seed, vocab_size, (512, 1536), (16, 128))


def shared_prefix(
    n: int, seed: int, vocab_size: int, prefix_tokens: int = SHARED_PREFIX_TOKENS
) -> list[WorkItem]:
    """Every prompt starts with the same `prefix_tokens` (the corpus's first tokens)."""
    tokens = corpus()
    prefix = _slice(tokens, 0, prefix_tokens, vocab_size)
    return [
        WorkItem(prefix + item.prompt, item.max_tokens)
        for item in _draw(n, seed, vocab_size, (32, 128), (16, 128))
    ]


def fit(items: list[WorkItem], max_model_len: int) -> list[WorkItem]:
    """Shrinks prompt and output of any item longer than `max_model_len` by the same factor."""
    fitted = []
    for item in items:
        total = len(item.prompt) + item.max_tokens
        if total <= max_model_len:
            fitted.append(item)
            continue
        factor = max_model_len / total
        prompt_len = max(1, int(len(item.prompt) * factor))
        out = max(1, min(int(item.max_tokens * factor), max_model_len - prompt_len))
        fitted.append(replace(item, prompt=item.prompt[:prompt_len], max_tokens=out))
    return fitted


def with_poisson_arrivals(items: list[WorkItem], rate_per_s: float, seed: int) -> list[WorkItem]:
    """The same requests arriving as a Poisson process of `rate_per_s` requests per second."""
    rng = random.Random(seed)
    t = 0.0
    timed = []
    for item in items:
        t += rng.expovariate(rate_per_s)
        timed.append(replace(item, arrival_s=t))
    return timed


def summary(items: list[WorkItem]) -> str:
    """'N requests, prompt A-B (mean M), output C-D (mean K)' for a table's notes."""
    prompts = [len(i.prompt) for i in items]
    outs = [i.max_tokens for i in items]
    return (
        f"{len(items)} requests, prompt {min(prompts)}-{max(prompts)} tokens "
        f"(mean {sum(prompts) / len(items):.0f}), "
        f"output {min(outs)}-{max(outs)} (mean {sum(outs) / len(items):.0f}), greedy, ignore_eos"
    )
