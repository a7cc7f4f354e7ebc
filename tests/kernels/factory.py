"""Paged K/V batches for kernel tests, built straight from dense per-sequence K/V.

Every cache slot that no sequence owns holds NaN, and every block-table entry past a sequence's
context points at an all-NaN "poison" block: a kernel that reads a slot it should mask turns
its output NaN, which assert_close reports.
"""

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence [context_len, kv_heads, head_dim], the dense truth
    values: list[torch.Tensor]
    slot_mappings: list[torch.Tensor]  # per sequence [context_len] int64
    poison_block: int


def make_paged_batch(
    context_lens: list[int],
    *,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # two spare blocks and the poison block
    order = torch.randperm(num_blocks, generator=gen).tolist()  # sequences get scattered blocks
    poison_block = order.pop()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), poison_block, dtype=torch.int32)
    keys, values, slot_mappings = [], [], []
    for i, (n, nb) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        block_ids = torch.tensor([order.pop() for _ in range(nb)])
        block_tables[i, :nb] = block_ids
        pos = torch.arange(n)
        slots = block_ids[pos // block_size] * block_size + pos % block_size
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        key_cache[slots // block_size, slots % block_size] = k
        value_cache[slots // block_size, slots % block_size] = v
        keys.append(k.to(device))
        values.append(v.to(device))
        slot_mappings.append(slots.to(device))
    return PagedBatch(
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        slot_mappings=slot_mappings,
        poison_block=poison_block,
    )


def make_queries(
    num_tokens: int, q_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu", seed: int = 1
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, q_heads, head_dim, generator=gen).to(dtype).to(device)


def query_start_loc(query_lens: list[int], device: str = "cpu") -> torch.Tensor:
    offsets = [0]
    for n in query_lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def dense_attention(
    query: torch.Tensor,  # [q_len, q_heads, head_dim], the last q_len tokens of the sequence
    keys: torch.Tensor,  # [context_len, kv_heads, head_dim]
    values: torch.Tensor,  # [context_len, kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [q_len, q_heads, head_dim] float64
    """Textbook causal softmax attention, one head at a time, in float64."""
    q_len, q_heads, _ = query.shape
    context_len, kv_heads, _ = keys.shape
    group = q_heads // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for h in range(q_heads):
        q = query[:, h].double()
        k = keys[:, h // group].double()
        v = values[:, h // group].double()
        scores = q @ k.T * scale
        for j in range(q_len):
            scores[j, context_len - q_len + j + 1 :] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ v
    return out
