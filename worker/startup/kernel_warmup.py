"""Compile every Triton kernel variant serving can reach, before the worker reports ready.

Triton compiles a kernel on its first launch with each new set of constexprs (and of integer /
alignment specializations): seconds that, mid-serving, every running request would wait through.
The variants a paged Triton worker can reach are fixed by its realized configuration:

    reshape_and_cache                 one (the model's KV heads, head size, block size, KV dtype)
    paged_prefill_attention           one (the query group, head size, block size, KV dtype)
    paged_decode_attention            one per split count the heuristic can pick for this
                                      max_model_len (kernels/splits.split_variants: 1, 2, 4, ... )
    merge_splits                      one per split count above 1

The block table's width, which changes from step to step, is not specialized (the kernels mark its
stride `do_not_specialize`), and every other integer argument is a stride fixed by the model's shapes.
The warm-up runs each variant once through the same `PagedAttentionStep` serving uses (layer 0, a few
tokens in blocks 0 and 1 of a pool that holds nothing yet), so each launch has the specializations
serving's launches have. `PagedCache.mark_ready` then starts the count of later compiles, which the
worker reports in WorkerLoad.kernel_compiles_after_ready (0 on a healthy worker).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvpact.kernels.compiles import compiled_variant_count
from kvpact.worker.kv.paged import PagedAttentionStep, PagedCache


@dataclass(frozen=True, slots=True)
class WarmupReport:
    variants: tuple[str, ...]  # what ran, e.g. "decode splits=4 (+ merge)"
    compiled: int  # kernel variants compiled by the warm-up (0 under the interpreter)
    seconds: float


def warm_up_paged_kernels(cache: PagedCache, *, num_heads: int, dtype: torch.dtype) -> WarmupReport:
    """Launch every kernel variant the cache's steps can launch (see the module docstring).
    `num_heads` and `dtype` are the model's query heads and activation dtype."""
    started = time.monotonic()
    before = compiled_variant_count()
    variants = []
    gen = torch.Generator().manual_seed(0)
    guard = torch.cuda.device(cache.device) if cache.device.type == "cuda" else nullcontext()
    with guard, torch.no_grad():
        for splits in cache.split_variants:
            # One decode (context 1, block 0) and, with the first, a 3-token prefill (block 1).
            with_prefill = splits == cache.split_variants[0]
            tables, starts, lengths = [[0]], [0], [1]
            if with_prefill:
                tables, starts, lengths = [[0], [1]], [0, 0], [1, 3]
            step = PagedAttentionStep(cache, tables, starts, lengths, num_decodes=1, decode_splits=splits)
            q, k, v = (
                torch.randn(sum(lengths), heads, cache.head_dim, generator=gen).to(cache.device, dtype)
                for heads in (num_heads, cache.num_kv_heads, cache.num_kv_heads)
            )
            step.forward(0, q, k, v)
            if with_prefill:
                variants += ["reshape_and_cache", "prefill"]
            variants.append(f"decode splits={splits}" + (" (+ merge)" if splits > 1 else ""))
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
    cache.mark_ready()
    return WarmupReport(tuple(variants), compiled_variant_count() - before, time.monotonic() - started)
