"""The paged KV cache: per-layer block pools and the AttentionStep that runs through them.

Per layer, `key[layer]` and `value[layer]` are [num_blocks, block_size, kv_heads, head_dim]; position
p of a sequence lives in slot `block_ids[p // block_size] * block_size + p % block_size` of its
block table (worker/block_manager.py owns the tables; this file only reads them).

A step writes every new token's K/V into the pools first (`reshape_and_cache`), then attends through
the pools: one-token chunks with `paged_decode_attention`, longer chunks (prefill, or extend after a
prefix-cache hit or a previous chunk) with `paged_prefill_attention`. The backend only chooses which
functions those are: TORCH = kernels.reference (CPU, MPS), TRITON = the Triton kernels (CUDA); they
share signatures and layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpact import kernels
from kvpact.shared.intent import PagedBackend
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.worker.device import to_device
from kvpact.worker.sequence import ScheduledChunk


@dataclass(frozen=True, slots=True)
class PagedOps:
    write: Callable[..., None]  # reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    decode: Callable[..., torch.Tensor]  # (query, key_cache, value_cache, block_tables, context_lens, scale)
    prefill: Callable[..., torch.Tensor]  # (query, ..., query_start_loc, context_lens, scale, max_query_len=)


def paged_ops(backend: PagedBackend) -> PagedOps:
    if backend is PagedBackend.TORCH:
        return PagedOps(
            kernels.reshape_and_cache_torch,
            kernels.paged_decode_attention_torch,
            kernels.paged_prefill_attention_torch,
        )
    if backend is PagedBackend.TRITON:  # imports triton: only on a worker whose decision chose it
        from kvpact.kernels.cache_write import reshape_and_cache
        from kvpact.kernels.decode_attention import paged_decode_attention
        from kvpact.kernels.prefill_attention import paged_prefill_attention

        return PagedOps(reshape_and_cache, paged_decode_attention, paged_prefill_attention)
    raise ValueError(f"the paged cache needs a concrete backend (torch or triton), got {backend}")


class PagedCache:
    kind = CacheKind.PAGED

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: PagedBackend,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Unused slots may hold anything: the kernels never read past a sequence's context.
        self.key = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.backend = backend
        self.ops = paged_ops(backend)
        self.scale = head_dim**-0.5
        self.device = device

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key + self.value)

    def attention_step(self, chunks: list[ScheduledChunk], num_decodes: int) -> PagedAttentionStep:
        return PagedAttentionStep(self, chunks, num_decodes)


class PagedAttentionStep:
    """One step's metadata, built once on the host, copied to the device without a stream sync and
    used by every layer: slot_mapping [num_tokens] int64; per group (decodes, then prefill chunks)
    block_tables [num_seqs, max_blocks] int32, as wide as that group's longest table (the decode
    kernel sizes its split-K from the width) and zero-padded (the kernels never read past a context),
    and context_lens [num_seqs] int32 (tokens in the cache after the write, the new ones included);
    prefill_start_loc [num_prefills + 1] int32 offsets into the prefill part of the batch and
    max_prefill_len, its longest chunk (so the prefill kernel need not read it back from the device)."""

    def __init__(self, cache: PagedCache, chunks: list[ScheduledChunk], num_decodes: int) -> None:
        self.cache = cache
        self.num_decodes = num_decodes
        dev, bs = cache.device, cache.block_size
        for c in chunks:
            covered = len(c.seq.block_table.block_ids) * bs
            assert covered >= c.end, f"sequence {c.seq.request_id}: blocks do not cover {c.end} tokens"
        decodes, prefills = chunks[:num_decodes], chunks[num_decodes:]
        decode_tables, tables = _block_tables(decodes), _block_tables(prefills)
        lengths = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
        starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
        context_lens = (starts + lengths).to(torch.int32)

        # Slots, per token: its chunk's block table at position // block_size, then the offset.
        width = max(decode_tables.shape[1], tables.shape[1])
        all_tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        all_tables[:num_decodes, : decode_tables.shape[1]] = decode_tables
        all_tables[num_decodes:, : tables.shape[1]] = tables
        seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
        first_token = torch.cumsum(lengths, 0) - lengths
        positions = starts[seq_of_token] + torch.arange(int(lengths.sum())) - first_token[seq_of_token]
        slots = all_tables[seq_of_token, positions // bs].long() * bs + positions % bs

        prefill_lengths = lengths[num_decodes:]
        self.slot_mapping = to_device(slots, dev)
        self.decode_tables = to_device(decode_tables, dev)
        self.decode_context_lens = to_device(context_lens[:num_decodes], dev)
        self.prefill_tables = to_device(tables, dev)
        self.prefill_context_lens = to_device(context_lens[num_decodes:], dev)
        self.prefill_start_loc = to_device(
            torch.cat([torch.zeros(1, dtype=torch.long), prefill_lengths.cumsum(0)]).to(torch.int32), dev
        )
        self.max_prefill_len = int(prefill_lengths.max()) if len(prefills) else 0
        self.has_prefills = len(prefills) > 0

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        key_cache, value_cache = cache.key[layer_idx], cache.value[layer_idx]
        dtype = key_cache.dtype
        cache.ops.write(
            k.to(dtype).contiguous(), v.to(dtype).contiguous(), key_cache, value_cache, self.slot_mapping
        )
        query = q.to(dtype).contiguous()
        out = torch.empty_like(query)
        d = self.num_decodes
        if d:
            out[:d] = cache.ops.decode(
                query[:d], key_cache, value_cache, self.decode_tables, self.decode_context_lens, cache.scale
            )
        if self.has_prefills:
            out[d:] = cache.ops.prefill(
                query[d:],
                key_cache,
                value_cache,
                self.prefill_tables,
                self.prefill_start_loc,
                self.prefill_context_lens,
                cache.scale,
                max_query_len=self.max_prefill_len,
            )
        return out.to(q.dtype)


def _block_tables(chunks: list[ScheduledChunk]) -> torch.Tensor:
    """[len(chunks), longest table (at least 1)] int32, each row zero-padded."""
    width = max((len(c.seq.block_table.block_ids) for c in chunks), default=1)
    rows = [c.seq.block_table.block_ids + [0] * (width - len(c.seq.block_table.block_ids)) for c in chunks]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(chunks), width)
