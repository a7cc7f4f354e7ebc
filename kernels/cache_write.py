"""Triton KV-cache write: scatter the new tokens' K/V into the paged block pools."""

import torch
import triton
import triton.language as tl

from kvpact.kernels import checks


@triton.jit
def kernel_reshape_and_cache(
    key_ptr,  # [num_tokens, kv_heads, head_dim]
    value_ptr,  # [num_tokens, kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padding
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: all of its heads at once.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    cache_offsets = (
        block * stride_cache_block
        + offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], written in place
    value_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    *,
    check: bool = True,  # False: the caller checked these shapes already (once per step)
) -> None:
    if check:
        checks.check_cache_write(key, value, key_cache, value_cache, slot_mapping)
        checks.check_triton_support(
            kernel_reshape_and_cache, key_cache, value_cache, key, value, slot_mapping
        )
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernel_reshape_and_cache[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        KV_HEADS=kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )
