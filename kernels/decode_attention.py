"""Triton paged decode attention (one new query token per sequence), split-K / flash-decoding.

Grid (num_seqs, kv_heads, num_splits): each program takes one KV head's group of query heads
and one contiguous range of the sequence's context, walks it TILE tokens at a time (gathering
each token's slot through the block table, so a tile may span cache blocks) and keeps an
online softmax in fp32. Each K/V tile is loaded once for the whole query-head group (GQA).
With one split the program writes the output; with more, each writes a normalized partial
output and its log-sum-exp, and kernel_merge_splits combines them.
"""

import torch
import triton
import triton.language as tl

from kvpact.kernels import checks
from kvpact.kernels.splits import (  # noqa: F401 - re-exported: the split heuristic's home is splits.py
    MAX_SPLITS,
    MIN_TILES_PER_SPLIT,
    PROGRAMS_PER_SM,
    TILE,
    choose_num_splits,
    decode_workspace,
    default_num_splits,
    device_num_sms,
    split_variants,
)

# The block table's row stride is its width, which grows with the batch's longest context: were it
# specialized (Triton keys ints on == 1 and % 16), a new width could compile a new kernel mid-serving.
UNSPECIALIZED = ["stride_block_tables_seq"]


@triton.jit(do_not_specialize=UNSPECIALIZED)
def kernel_paged_decode_attention(
    out_ptr,  # [num_seqs, q_heads, head_dim], or fp32 [num_seqs, q_heads, NUM_SPLITS, head_dim] if split
    lse_ptr,  # fp32 [num_seqs, q_heads, NUM_SPLITS], log2-sum-exp2 of scaled scores (NUM_SPLITS > 1 only)
    query_ptr,  # [num_seqs, q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    context_lens_ptr,  # [num_seqs] int32
    scale,  # softmax scale
    stride_query_seq,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_tables_seq,
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUERY_GROUP: tl.constexpr,  # q_heads // kv_heads
    GROUP_PAD: tl.constexpr,  # >= 16 (tl.dot minimum), power of two
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,  # cast tiles to fp32 after load (bf16 under the interpreter)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * QUERY_GROUP + group
    head_mask = group < QUERY_GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]
    if COMPUTE_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax with exp2

    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile in range(tile_start, tile_end):
        pos = tile * TILE + tl.arange(0, TILE)
        pos_mask = pos < context_len
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

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, TILE]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        row_max_new = tl.maximum(row_max, tl.max(s, 1))
        p = tl.exp2(s - row_max_new[:, None])
        alpha = tl.exp2(row_max - row_max_new)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        row_max = row_max_new

    # An empty split (short context) has row_sum == 0: it writes zeros and lse = -inf (merge ignores it).
    row_sum_safe = tl.where(row_sum > 0, row_sum, 1.0)
    out = acc / row_sum_safe[:, None]
    out_offsets = (
        seq * stride_out_seq + heads[:, None] * stride_out_head + split * stride_out_split + dims[None, :]
    )
    tl.store(
        out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :]
    )
    if NUM_SPLITS > 1:
        lse = tl.where(row_sum > 0, row_max + tl.log2(row_sum_safe), float("-inf"))
        q_heads = tl.num_programs(1) * QUERY_GROUP
        tl.store(lse_ptr + (seq * q_heads + heads) * NUM_SPLITS + split, lse, mask=head_mask)


@triton.jit
def kernel_merge_splits(
    out_ptr,  # [num_seqs, q_heads, head_dim]
    partial_ptr,  # fp32 [num_seqs, q_heads, NUM_SPLITS, head_dim], contiguous
    lse_ptr,  # fp32 [num_seqs, q_heads, NUM_SPLITS], contiguous
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head  # (seq, head) index into the contiguous partials
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < NUM_SPLITS
    dim_mask = dims < HEAD_DIM

    lse = tl.load(lse_ptr + row * NUM_SPLITS + splits, mask=split_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    partial = tl.load(
        partial_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, >= 1, includes the current token
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True,
) -> torch.Tensor:  # [num_seqs, q_heads, head_dim]
    """Triton twin of reference.paged_decode_attention_torch. num_splits=None picks by heuristic
    (default_num_splits) from shapes only (block_tables' width bounds the context; no device sync).

    Per-step callers (worker/kv/paged.py) pass `out` (written in place, query's shape and dtype,
    last dim contiguous), `workspace` (decode_workspace for this num_splits) and check=False
    after checking the step's shapes once."""
    if check:
        checks.check_decode(query, key_cache, value_cache, block_tables, context_lens)
        checks.check_triton_support(
            kernel_paged_decode_attention, key_cache, query, block_tables, context_lens
        )
    num_seqs, q_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    if num_splits is None:
        num_splits = default_num_splits(
            num_seqs, kv_heads, block_tables.shape[1] * block_size, device_num_sms(query.device)
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    elif check:
        checks.check_out("out", out, query)
    if num_seqs == 0:
        return out
    if num_splits == 1:
        partial, lse = out, out  # lse is unused with one split
        partial_strides: tuple[int, ...] = (out.stride(0), out.stride(1), 0)
    else:
        if workspace is None:
            workspace = decode_workspace(num_seqs, q_heads, head_dim, num_splits, query.device)
            assert workspace is not None
        partial, lse = workspace
        if check and (
            tuple(partial.shape) != (num_seqs, q_heads, num_splits, head_dim)
            or tuple(lse.shape) != (num_seqs, q_heads, num_splits)
            or not (partial.is_contiguous() and lse.is_contiguous())
        ):
            raise ValueError(
                f"workspace must be decode_workspace({num_seqs}, {q_heads}, {head_dim}, {num_splits}), "
                f"got shapes {tuple(partial.shape)} and {tuple(lse.shape)}"
            )
        partial_strides = partial.stride()[:3]
    group = q_heads // kv_heads
    kernel_paged_decode_attention[(num_seqs, kv_heads, num_splits)](
        partial,
        lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        *partial_strides,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        QUERY_GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        TILE=TILE,
        NUM_SPLITS=num_splits,
        COMPUTE_FP32=checks.is_interpreted(kernel_paged_decode_attention) and query.dtype == torch.bfloat16,
        num_warps=4,
    )
    if num_splits > 1:
        kernel_merge_splits[(num_seqs, q_heads)](
            out,
            partial,
            lse,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
