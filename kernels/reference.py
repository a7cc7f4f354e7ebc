"""Pure-torch paged attention: the references the Triton kernels are tested against, and the
CPU worker's "torch paged backend".

Layouts (shared with the Triton kernels):
  key_cache, value_cache  [num_blocks, block_size, kv_heads, head_dim]
  block_tables            [num_seqs, max_blocks_per_seq] int32; entries past a sequence's
                          context are never used (they may hold anything)
  slot                    block_id * block_size + offset; -1 = padding

Attention math runs in fp32 and returns the query dtype. Query head h reads KV head
h // (q_heads // kv_heads) (GQA).
"""

import torch

from kvpact.kernels import checks


def reshape_and_cache_torch(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    checks.check_cache_write(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]


def paged_decode_attention_torch(
    query: torch.Tensor,  # [num_seqs, q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, >= 1, includes the current token
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_seqs, q_heads, head_dim]
    """One query token per sequence attends to its first context_lens[i] cached tokens.
    `num_splits` is accepted for the Triton twin's signature; this computes in one pass."""
    checks.check_decode(query, key_cache, value_cache, block_tables, context_lens)
    num_seqs, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = q_heads // kv_heads
    num_blocks = -(-int(context_lens.max()) // block_size)
    num_tokens = num_blocks * block_size

    # Gather every sequence's blocks, padded to the longest context (padding is masked below),
    # KV-head-major so both batched matmuls run over (kv_head, seq) without copies.
    pos = torch.arange(num_tokens, device=query.device)
    invalid = pos[None, :] >= context_lens[:, None]  # [num_seqs, num_tokens]
    block_ids = block_tables[:, :num_blocks].masked_fill(invalid[:, ::block_size], 0).long().flatten()
    # Gather first, then permute: index_select on a permuted pool would copy the whole pool each call.
    gathered_shape = (num_seqs, num_tokens, kv_heads, head_dim)
    k = key_cache.index_select(0, block_ids).view(gathered_shape).permute(2, 0, 1, 3).float()
    v = value_cache.index_select(0, block_ids).view(gathered_shape).permute(2, 0, 1, 3).float()
    v.masked_fill_(invalid[None, :, :, None], 0.0)  # unused slots may hold NaN, and 0 * NaN = NaN

    q = (query.float() * scale).view(num_seqs, kv_heads, group, head_dim).transpose(0, 1)
    scores = q @ k.transpose(2, 3)  # [kv_heads, num_seqs, group, num_tokens]
    scores.masked_fill_(invalid[None, :, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [kv_heads, num_seqs, group, head_dim]
    return out.transpose(0, 1).reshape(num_seqs, q_heads, head_dim).to(query.dtype)


def paged_prefill_attention_torch(
    query: torch.Tensor,  # [num_tokens, q_heads, head_dim], sequences back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative offsets into query
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens including the new ones
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, q_heads, head_dim]
    """Causal attention for a ragged batch of new tokens whose K/V are already in the cache.

    Sequence i's j-th new token sits at position context_lens[i] - q_len_i + j and attends to
    positions 0..that position (cached prefix + new tokens up to itself). `max_query_len` is
    accepted for the Triton twin's signature and not needed here (this reads the offsets itself).
    """
    checks.check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    _, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = q_heads // kv_heads
    starts = query_start_loc.tolist()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-context_len // block_size)
        block_ids = block_tables[i, :num_blocks].long()
        k = key_cache[block_ids].view(-1, kv_heads, head_dim)[:context_len].float()
        v = value_cache[block_ids].view(-1, kv_heads, head_dim)[:context_len].float()

        q = query[start:end].float().view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = q @ k.permute(1, 2, 0)[:, None] * scale  # [kv_heads, group, q_len, context_len]
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
        causal = torch.arange(context_len, device=query.device)[None, :] <= q_pos[:, None]
        scores.masked_fill_(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = probs @ v.transpose(0, 1)[:, None]  # [kv_heads, group, q_len, head_dim]
        out[start:end] = o.permute(2, 0, 1, 3).reshape(q_len, q_heads, head_dim).to(query.dtype)
    return out
