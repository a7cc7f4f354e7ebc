"""Triton paged prefill / extend attention: causal attention for a ragged batch of new tokens whose
K/V are already written to the cache (the cached prefix and the new chunk are read alike).

Grid (num_seqs, kv_heads, query tiles): a program owns BLOCK_Q new tokens of one sequence times
the QUERY_GROUP query heads sharing one KV head, packed as BLOCK_M = BLOCK_Q * GROUP_PAD rows
(row r = token r // GROUP_PAD, head r % GROUP_PAD), so each K/V tile is loaded once per group.
It walks the context TILE tokens at a time up to its last token's position (causal), with an
online softmax in fp32.
"""

import torch
import triton
import triton.language as tl

from kvpact.kernels import checks

BLOCK_M = 64  # query rows (tokens x grouped heads) per program
TILE = 32  # context tokens per loop iteration


# As in decode_attention: the block table's width must not pick a new compiled variant.
UNSPECIALIZED = ["stride_block_tables_seq"]


@triton.jit(do_not_specialize=UNSPECIALIZED)
def kernel_paged_prefill_attention(
    out_ptr,  # [num_tokens, q_heads, head_dim]
    query_ptr,  # [num_tokens, q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    context_lens_ptr,  # [num_seqs] int32, includes the new tokens
    scale,  # softmax scale
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_tables_seq,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUERY_GROUP: tl.constexpr,  # q_heads // kv_heads
    GROUP_PAD: tl.constexpr,  # next power of two of QUERY_GROUP
    BLOCK_Q: tl.constexpr,  # new tokens per program; BLOCK_Q * GROUP_PAD >= 16 (tl.dot minimum)
    TILE: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,  # cast tiles to fp32 after load (bf16 under the interpreter)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_tile * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - query_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tokens = q_tile * BLOCK_Q + rows // GROUP_PAD  # index among this sequence's new tokens
    group = rows % GROUP_PAD
    heads = kv_head * QUERY_GROUP + group
    row_mask = (tokens < query_len) & (group < QUERY_GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr
        + (query_start + tokens)[:, None] * stride_query_token
        + heads[:, None] * stride_query_head
        + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if COMPUTE_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax with exp2
    q_pos = prefix_len + tokens  # absolute position of each row's token
    kv_end = tl.minimum(prefix_len + (q_tile + 1) * BLOCK_Q, context_len)  # causal bound of the tile

    row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(0, tl.cdiv(kv_end, TILE)):
        pos = tile * TILE + tl.arange(0, TILE)
        pos_mask = pos < kv_end
        block = tl.load(
            block_tables_ptr + seq * stride_block_tables_seq + pos // BLOCK_SIZE, mask=pos_mask, other=0
        )
        slot_offsets = (
            block.to(tl.int64) * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        kv_offsets = slot_offsets[:, None] + dims[None, :]  # [TILE, HEAD_DIM_PAD]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if COMPUTE_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, TILE]
        s = tl.where(pos_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        row_max_new = tl.maximum(row_max, tl.max(s, 1))
        p = tl.exp2(s - row_max_new[:, None])
        alpha = tl.exp2(row_max - row_max_new)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        row_max = row_max_new

    # Every real row sees position 0, so row_sum > 0 there; padding rows are not stored.
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr
        + (query_start + tokens)[:, None] * stride_out_token
        + heads[:, None] * stride_out_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, q_heads, head_dim], sequences back to back
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative offsets into query
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens including the new ones
    scale: float,
    max_query_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    key: torch.Tensor | None = None,  # the step's own K/V: PagedOps's signature; this reads the cache
    value: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:  # [num_tokens, q_heads, head_dim]
    """Triton twin of reference.paged_prefill_attention_torch. `max_query_len`, the longest
    new-token run (at least it: it sizes the grid), as the caller knows it on the host; None reads
    it from query_start_loc, one device sync. `out` (query's shape and dtype) is written in place;
    check=False skips the argument checks (a per-step caller checks once)."""
    if check:
        checks.check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
        checks.check_triton_support(
            kernel_paged_prefill_attention, key_cache, query, block_tables, query_start_loc, context_lens
        )
    num_tokens, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    num_seqs = context_lens.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif check:
        checks.check_out("out", out, query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1 for {num_tokens} query tokens, got {max_query_len}")
    group = q_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_M // group_pad)
    kernel_paged_prefill_attention[(num_seqs, kv_heads, triton.cdiv(max_query_len, block_q))](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        QUERY_GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        TILE=TILE,
        COMPUTE_FP32=checks.is_interpreted(kernel_paged_prefill_attention) and query.dtype == torch.bfloat16,
        num_warps=4,
    )
    return out
