"""The Triton paged kernels' startup self-test: do they run on this GPU, with this model's shapes?

The capability decision (shared/capability.py) knows what the kernels support on paper; a worker
that says PAGED with the Triton backend should also have seen them run, or `--paged-attn on` could
start a cluster whose every request fails (a Triton that cannot compile for this GPU, a driver too
old for Triton's ptxas). So before any weight is read, `triton_self_test` runs each kernel once on
the worker's device with the model's head size, query/KV head counts, KV dtype and block size, on
two short sequences in scattered blocks:

    reshape_and_cache                    5 + 37 tokens into an empty pool    must equal the torch write
    paged_prefill_attention              5 new tokens; 9 after a 28-token    within TOLERANCES of the
                                         cached prefix                       torch reference
    paged_decode_attention (1, 2 splits) the same two contexts               likewise

It returns None when all agree and otherwise the Finding for the fallback door (component "kernels").
It also compiles the kernel variants the first requests use, so they do not pay for it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from kvpact.kernels import reference
from kvpact.shared.reasons import KERNEL_ACCURACY, KERNEL_SELF_TEST, Finding
from kvpact.worker.kv.paged import PagedOps

CONTEXT_LENS = (5, 37)
NEW_TOKENS = (5, 9)
# max |triton - torch| allowed, on values of order 1 (random inputs, softmax-weighted averages)
TOLERANCES = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def triton_self_test(
    device: torch.device,
    dtype: torch.dtype,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    ops: PagedOps | None = None,
) -> Finding | None:
    """None when the Triton kernels (or `ops`, for tests) match the torch references on `device`,
    else why not, naming --pa-backend torch as the way to keep PagedAttention without them."""
    where = _device_name(device)
    try:
        if ops is None:
            from kvpact.kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache

            ops = PagedOps(reshape_and_cache, paged_decode_attention, paged_prefill_attention)
        guard = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
        with guard, torch.no_grad():
            errors = _compare(ops, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
    except Exception as e:  # noqa: BLE001 - any failure to compile or launch is the finding
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return KERNEL_SELF_TEST.found(where=where, error=f"{type(e).__name__}: {message[:300]}")
    tolerance = TOLERANCES[dtype]
    for name, error in errors.items():
        if not error <= tolerance:  # NaN fails too
            return KERNEL_ACCURACY.found(
                kernel=name,
                error=f"{error:.3g}",
                tolerance=f"{tolerance:g}",
                dtype=str(dtype).removeprefix("torch."),
                where=where,
            )
    return None


def _compare(
    ops: PagedOps,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> dict[str, float]:
    """Max |ops - reference| per kernel, on random inputs made on the CPU (same for every device)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    blocks_per_seq = [-(-n // block_size) for n in CONTEXT_LENS]
    num_blocks = sum(blocks_per_seq) + 1
    free = list(range(num_blocks - 1, 0, -1))  # scattered, and block 0 left unused
    table_rows, slots = [], []
    for n, count in zip(CONTEXT_LENS, blocks_per_seq, strict=True):
        ids = [free.pop() for _ in range(count)][::-1]
        table_rows.append(ids + [0] * (max(blocks_per_seq) - count))
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(n)]
    block_tables = torch.tensor(table_rows, dtype=torch.int32).to(device)
    slot_mapping = torch.tensor(slots, dtype=torch.int64).to(device)
    context_lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32).to(device)

    total = sum(CONTEXT_LENS)
    key, value = randn(total, num_kv_heads, head_dim), randn(total, num_kv_heads, head_dim)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.zeros(shape, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    ref_key_cache, ref_value_cache = key_cache.clone(), value_cache.clone()
    ops.write(key, value, key_cache, value_cache, slot_mapping)
    reference.reshape_and_cache_torch(key, value, ref_key_cache, ref_value_cache, slot_mapping)
    errors = {
        "KV cache write": max(_max_error(key_cache, ref_key_cache), _max_error(value_cache, ref_value_cache))
    }

    cache = (ref_key_cache, ref_value_cache, block_tables)  # attention reads the reference's write
    scale = head_dim**-0.5
    starts = torch.tensor([0, *torch.tensor(NEW_TOKENS).cumsum(0).tolist()], dtype=torch.int32).to(device)
    query = randn(sum(NEW_TOKENS), num_heads, head_dim)
    got = ops.prefill(query, *cache, starts, context_lens, scale, max_query_len=max(NEW_TOKENS))
    errors["prefill attention"] = _max_error(
        got, reference.paged_prefill_attention_torch(query, *cache, starts, context_lens, scale)
    )
    query = randn(len(CONTEXT_LENS), num_heads, head_dim)
    want = reference.paged_decode_attention_torch(query, *cache, context_lens, scale)
    for splits in (1, 2):
        got = ops.decode(query, *cache, context_lens, scale, num_splits=splits)
        errors[f"decode attention ({splits} split{'s' if splits > 1 else ''})"] = _max_error(got, want)
    return errors


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    return float((got.float() - want.float()).abs().max())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            return f"{torch.cuda.get_device_name(device)} ({device})"
        except Exception:  # noqa: BLE001 - the name is only for the message
            return str(device)
    return str(device)
