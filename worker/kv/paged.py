"""The paged KV cache: per-layer block pools and the AttentionStep that runs through them.

Per layer, `key[layer]` and `value[layer]` are [num_blocks, block_size, kv_heads, head_dim]; position
p of a sequence lives in slot `block_ids[p // block_size] * block_size + p % block_size` of its
block table (worker/scheduler/block_manager.py owns the tables; this file only reads them).

A step writes every new token's K/V into the pools first (`reshape_and_cache`), then attends through
the pools: one-token chunks with `paged_decode_attention`, longer chunks (prefill, or extend after a
prefix-cache hit or a previous chunk) with `paged_prefill_attention` (on the CPU kernels a chunk with
no cached prefix attends on its own K/V instead of gathering its blocks back). The backend only chooses which
functions those are: TORCH = kernels/cpu_paged.py on a CPU float32 or bfloat16 cache (C decode reading
blocks in place), else kernels/reference.py (MPS, float16, no C compiler); TRITON = the Triton kernels
(CUDA). They share signatures and layouts; `PagedCache.kernels` says which run. The C kernels take
float32 queries and K/V rows over either cache (`PagedCache.rows_dtype`); the others, the cache's dtype.

Host work is per step, not per layer: the step checks the kernels' arguments on its first layer only,
picks the decode split count once (kernels/splits.py, capped at the largest count the startup warm-up
compiled, worker/startup/kernel_warmup.py), and allocates the output and the split partials/LSEs once; every
layer's kernels write into them (`out=`), so a decode layer is a write, a decode (+ merge) and no copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpact import kernels
from kvpact.kernels import cpu_paged
from kvpact.kernels.compiles import compiled_variant_count
from kvpact.kernels.splits import decode_workspace, default_num_splits, device_num_sms, split_variants
from kvpact.shared.intent import PagedBackend
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.worker.engine.accelerator import to_device
from kvpact.worker.engine.sequence import ScheduledChunk
from kvpact.worker.scheduler.block_manager import block_slots


@dataclass(frozen=True, slots=True)
class PagedOps:
    """The three kernels of a backend, one signature for both (the Triton wrappers'):

    write(key, value, key_cache, value_cache, slot_mapping, *, check=True)
    decode(query, key_cache, value_cache, block_tables, context_lens, scale, num_splits=None,
           *, out=None, workspace=None, check=True) -> out
    prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
            max_query_len=None, *, out=None, key=None, value=None, check=True) -> out

    `key`/`value` in prefill are the step's own new K/V (laid out like query, already written): a
    backend may attend a sequence with no cached prefix on them instead of gathering its blocks (the C
    kernels' prefill does); the others read the cache.
    """

    write: Callable[..., None]
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]


def _torch_write(key, value, key_cache, value_cache, slot_mapping, *, check=True) -> None:  # noqa: ANN001
    kernels.reshape_and_cache_torch(key, value, key_cache, value_cache, slot_mapping)


def _torch_decode(  # noqa: ANN001 - the reference's arguments, passed through
    query, key_cache, value_cache, block_tables, context_lens, scale, num_splits=None, *, out=None, **_
) -> torch.Tensor:
    got = kernels.paged_decode_attention_torch(
        query, key_cache, value_cache, block_tables, context_lens, scale
    )
    return got if out is None else out.copy_(got)


def _torch_prefill(  # noqa: ANN001 - the reference's arguments, passed through
    query,
    key_cache,
    value_cache,
    block_tables,
    starts,
    context_lens,
    scale,
    max_query_len=None,
    *,
    out=None,
    **_,
) -> torch.Tensor:
    got = kernels.paged_prefill_attention_torch(
        query, key_cache, value_cache, block_tables, starts, context_lens, scale
    )
    return got if out is None else out.copy_(got)


def reference_ops() -> PagedOps:
    """kernels/reference.py behind the Triton wrappers' signature: any device and dtype, slow."""
    return PagedOps(_torch_write, _torch_decode, _torch_prefill)


def paged_ops(
    backend: PagedBackend,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    cpu_kernels: bool = True,
) -> tuple[PagedOps, str]:
    """The backend's kernels and a line saying which they are (logged at startup). TORCH: the C kernels
    of kernels/cpu_paged.py (decode reads blocks in place) where the plan realized --cpu-kernels, else
    the references. The plan decides; this only builds what it decided."""
    if backend is PagedBackend.TORCH:
        if not cpu_kernels:
            return reference_ops(), "pure-torch reference kernels (cpu-kernels realized off)"
        native = cpu_paged.required(dtype, device or torch.device("cpu"))
        return PagedOps(native.write, native.decode, native.prefill), f"CPU C kernels ({native.path.name})"
    if backend is PagedBackend.TRITON:  # imports triton: only on a worker whose decision chose it
        from kvpact.kernels.cache_write import reshape_and_cache
        from kvpact.kernels.decode_attention import paged_decode_attention
        from kvpact.kernels.prefill_attention import paged_prefill_attention

        return PagedOps(reshape_and_cache, paged_decode_attention, paged_prefill_attention), "Triton kernels"
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
        *,
        max_model_len: int | None = None,
        cpu_kernels: bool = True,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not for the values (the kernels never read past a sequence's context) but to touch
        # every page now: on a CPU an untouched pool faults its pages in during the first requests'
        # steps (4 long prompts in-process took 17.5 s on a fresh pool against 11.8 s on a touched one,
        # on a VM half an hour after boot; docs/performance.md "A cold KV pool"), and the eager cache's
        # zeros already paid this at startup.
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.backend = backend
        self.ops, self.kernels = paged_ops(backend, dtype, device, cpu_kernels)
        self.cpu_kernels = isinstance(getattr(self.ops.write, "__self__", None), cpu_paged.CpuPagedOps)
        # the dtype of what the kernels take and give (query, new K/V, output): float32 on the C kernels
        self.rows_dtype = torch.float32 if self.cpu_kernels else dtype
        self.scale = head_dim**-0.5
        self.device = device
        self.num_sms = device_num_sms(device)
        # Every decode split count a step may pick (the warm-up compiles each); a context past
        # max_model_len (never scheduled) would be capped at the largest, not compile a new one.
        longest = max_model_len if max_model_len is not None else num_blocks * block_size
        self.split_variants = split_variants(
            num_kv_heads, -(-longest // block_size) * block_size, self.num_sms
        )
        self._compiles_at_ready: int | None = None

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key + self.value)

    def attention_step(self, chunks: list[ScheduledChunk], num_decodes: int) -> PagedAttentionStep:
        for c in chunks:
            covered = len(c.seq.block_table.block_ids) * self.block_size
            assert covered >= c.end, f"sequence {c.seq.request_id}: blocks do not cover {c.end} tokens"
        return PagedAttentionStep(
            self,
            [c.seq.block_table.block_ids for c in chunks],
            [c.start for c in chunks],
            [c.num_tokens for c in chunks],
            num_decodes,
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write (n > 1 forks): block dst of every layer's pools becomes a copy of block src."""
        src = to_device(torch.tensor([s for s, _ in copies], dtype=torch.long), self.device)
        dst = to_device(torch.tensor([d for _, d in copies], dtype=torch.long), self.device)
        for pool in (*self.key, *self.value):
            pool[dst] = pool[src]

    def decode_splits(self, num_decodes: int, table_width: int) -> int:
        """The split count for a step's decodes (the heuristic on the block table's width, no sync)."""
        if num_decodes == 0:
            return 1
        wanted = default_num_splits(
            num_decodes, self.num_kv_heads, table_width * self.block_size, self.num_sms
        )
        return min(wanted, self.split_variants[-1])

    def mark_ready(self) -> None:
        """The warm-up is done: compiles from now on are counted by kernel_compiles_after_ready."""
        self._compiles_at_ready = compiled_variant_count()

    def kernel_compiles_after_ready(self) -> int:
        """Triton kernel variants compiled since mark_ready (0 before it, and on the torch backend)."""
        if self._compiles_at_ready is None:
            return 0
        return compiled_variant_count() - self._compiles_at_ready


class PagedAttentionStep:
    """One step's metadata, built once on the host, copied to the device without a stream sync and
    used by every layer: slot_mapping [num_tokens] int64; per group (decodes, then prefill chunks)
    block_tables [num_seqs, max_blocks] int32, as wide as that group's longest table (the decode
    split count comes from the width) and zero-padded (the kernels never read past a context),
    and context_lens [num_seqs] int32 (tokens in the cache after the write, the new ones included);
    prefill_start_loc [num_prefills + 1] int32 offsets into the prefill part of the batch and
    max_prefill_len, its longest chunk (so the prefill kernel need not read it back from the device);
    the prefill group's tensors exist only where `has_prefills` (a decodes-only step builds three
    tensors, not six: at batch 1 this metadata is part of what a step spends outside its matmuls);
    decode_splits, chosen once. Sequence i has block table `tables[i]` and computes tokens
    `starts[i] : starts[i] + lengths[i]`; the first num_decodes are one-token decodes.

    `forward` returns a buffer of the step's: valid until the step's next `forward` (each layer
    consumes its attention output before the next layer runs)."""

    def __init__(
        self,
        cache: PagedCache,
        tables: list[list[int]],
        starts: list[int],
        lengths: list[int],
        num_decodes: int,
        *,
        decode_splits: int | None = None,
    ) -> None:
        self.cache = cache
        self.num_decodes = d = num_decodes
        dev, bs = cache.device, cache.block_size
        # Built in Python and made tensors once each: a step of 32 decodes spent ~300 us in a dozen small
        # torch ops here, ~0.6% of a 50 ms step the eager cache did not pay.
        slots: list[int] = []
        for table, start, n in zip(tables, starts, lengths, strict=True):
            slots += block_slots(table, start, start + n, bs)
        context_lens = [start + n for start, n in zip(starts, lengths, strict=True)]
        self.slot_mapping = to_device(torch.tensor(slots, dtype=torch.int64), dev)
        self.decode_tables = to_device(_block_tables(tables[:d]), dev)
        self.decode_context_lens = to_device(torch.tensor(context_lens[:d], dtype=torch.int32), dev)
        self.has_prefills = len(tables) > num_decodes
        self.max_prefill_len = 0
        if self.has_prefills:  # a decodes-only step (most steps) builds none of the prefill half
            prefill_lengths = lengths[d:]
            self.prefill_tables = to_device(_block_tables(tables[d:]), dev)
            self.prefill_context_lens = to_device(torch.tensor(context_lens[d:], dtype=torch.int32), dev)
            self.prefill_start_loc = to_device(
                torch.tensor([0, *itertools.accumulate(prefill_lengths)], dtype=torch.int32), dev
            )
            self.max_prefill_len = max(prefill_lengths)
        self.decode_splits = (
            decode_splits
            if decode_splits is not None
            else cache.decode_splits(num_decodes, self.decode_tables.shape[1])
        )
        self._out: torch.Tensor | None = None  # allocated by the first layer, reused by the others
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def static_decode(
        cls,
        cache: PagedCache,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> PagedAttentionStep:
        """A decode-only step on device tensors its owner rewrites between uses (worker/engine/
        decode_graphs.py): the split count fixed from the tables' full width, so one captured graph
        serves every context length up to it."""
        self = cls.__new__(cls)
        self.cache, self.num_decodes = cache, len(slot_mapping)
        self.slot_mapping, self.decode_tables, self.decode_context_lens = (
            slot_mapping,
            block_tables,
            context_lens,
        )
        self.has_prefills, self.max_prefill_len = False, 0
        self.decode_splits = cache.decode_splits(self.num_decodes, block_tables.shape[1])
        self._out, self._workspace = None, None
        return self

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        key_cache, value_cache = cache.key[layer_idx], cache.value[layer_idx]
        dtype = cache.rows_dtype
        same = q.dtype == dtype  # then no casts at all (the kernels read through strides)
        query, key, value = (q, k, v) if same else (q.to(dtype), k.to(dtype), v.to(dtype))
        d = self.num_decodes
        only_decodes = d == query.shape[0]  # then no slices either: a no-op view is a dispatch too
        check = self._out is None  # the first layer checks the step's shapes for all of them
        if check:
            self._out = torch.empty(query.shape, dtype=dtype, device=query.device)
            if d and cache.backend is PagedBackend.TRITON:
                self._workspace = decode_workspace(
                    d, query.shape[1], query.shape[2], self.decode_splits, query.device
                )
        out = self._out
        assert out is not None
        cache.ops.write(key, value, key_cache, value_cache, self.slot_mapping, check=check)
        if d:
            cache.ops.decode(
                query if only_decodes else query[:d],
                key_cache,
                value_cache,
                self.decode_tables,
                self.decode_context_lens,
                cache.scale,
                self.decode_splits,
                out=out if only_decodes else out[:d],
                workspace=self._workspace,
                check=check,
            )
        if self.has_prefills:
            cache.ops.prefill(
                query[d:],
                key_cache,
                value_cache,
                self.prefill_tables,
                self.prefill_start_loc,
                self.prefill_context_lens,
                cache.scale,
                self.max_prefill_len,
                out=out[d:],
                key=key[d:],
                value=value[d:],
                check=check,
            )
        return out if same else out.to(q.dtype)


def _block_tables(tables: list[list[int]]) -> torch.Tensor:
    """[len(tables), longest table (at least 1)] int32, each row zero-padded."""
    width = max((len(t) for t in tables), default=1)
    flat: list[int] = []
    for t in tables:
        flat += t
        flat += [0] * (width - len(t))
    return torch.tensor(flat, dtype=torch.int32).view(len(tables), width)
