"""Argument checks shared by the torch references and the Triton wrappers.

Each check raises ValueError naming the argument, what it got and what it needs. None of them
reads tensor values (no device sync), only shapes, strides, dtypes and devices.
"""

import torch

from kvpact.kernels import support

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        _fail(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        _fail(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")


def _check_index_vector(name: str, t: torch.Tensor, dtype: torch.dtype, layout: str) -> None:
    """A 1-D, contiguous tensor of `dtype` (slot mappings, lengths, offsets)."""
    _check_dim(name, t, 1, layout)
    _check_dtype(name, t, (dtype,))
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous")


def check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _check_dim("key_cache", key_cache, 4, "[num_blocks, block_size, kv_heads, head_dim]")
    if value_cache.shape != key_cache.shape:
        _fail(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}")
    if value_cache.stride() != key_cache.stride():
        _fail(f"value_cache strides {value_cache.stride()} != key_cache strides {key_cache.stride()}")
    if value_cache.dtype != key_cache.dtype:
        _fail(f"value_cache dtype {value_cache.dtype} != key_cache dtype {key_cache.dtype}")
    _check_dtype("key_cache", key_cache, _FLOAT_DTYPES)
    _check_last_dim_contiguous("key_cache", key_cache)


def check_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rows_dtype: torch.dtype | None = None,
) -> None:
    """rows_dtype: what key and value must be (None: the cache's; the C kernels write float32 rows)."""
    check_caches(key_cache, value_cache)
    _, _, kv_heads, head_dim = key_cache.shape
    _check_dim("key", key, 3, "[num_tokens, kv_heads, head_dim]")
    if key.shape[1:] != (kv_heads, head_dim):
        _fail(f"key is {tuple(key.shape)} but the cache holds kv_heads={kv_heads}, head_dim={head_dim}")
    if value.shape != key.shape:
        _fail(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    want = rows_dtype or key_cache.dtype
    for name, t in (("key", key), ("value", value)):
        if t.dtype != want:
            _fail(f"{name} dtype {t.dtype} != {'cache ' if rows_dtype is None else ''}dtype {want}")
        _check_last_dim_contiguous(name, t)
    _check_index_vector("slot_mapping", slot_mapping, torch.int64, "[num_tokens]")
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def _check_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows_dtype: torch.dtype | None = None,
) -> None:
    check_caches(key_cache, value_cache)
    _, _, kv_heads, head_dim = key_cache.shape
    num_seqs = context_lens.shape[0]
    if query.shape[2] != head_dim:
        _fail(f"query head_dim {query.shape[2]} != cache head_dim {head_dim}")
    if query.shape[1] % kv_heads != 0:
        _fail(f"query heads ({query.shape[1]}) must be a multiple of kv_heads ({kv_heads})")
    if query.dtype != (rows_dtype or key_cache.dtype):
        want = f"cache dtype {key_cache.dtype}" if rows_dtype is None else f"dtype {rows_dtype}"
        _fail(f"query dtype {query.dtype} != {want}")
    _check_last_dim_contiguous("query", query)
    _check_dim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq] int32")
    _check_dtype("block_tables", block_tables, (torch.int32,))
    if block_tables.shape[0] != num_seqs:
        _fail(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    _check_last_dim_contiguous("block_tables", block_tables)
    _check_index_vector("context_lens", context_lens, torch.int32, "[num_seqs] int32")


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    rows_dtype: torch.dtype | None = None,
) -> None:
    """rows_dtype: what query must be (None: the cache's; the C kernels take float32 queries)."""
    _check_dim("query", query, 3, "[num_seqs, q_heads, head_dim]")
    if query.shape[0] != context_lens.shape[0]:
        _fail(f"query has {query.shape[0]} sequences but context_lens has {context_lens.shape[0]}")
    _check_attention(query, key_cache, value_cache, block_tables, context_lens, rows_dtype)


def check_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    _check_dim("query", query, 3, "[num_tokens, q_heads, head_dim]")
    _check_index_vector("query_start_loc", query_start_loc, torch.int32, "[num_seqs + 1] int32")
    if query_start_loc.shape[0] != context_lens.shape[0] + 1:
        _fail(
            f"query_start_loc has {query_start_loc.shape[0]} entries; "
            f"needs num_seqs + 1 = {context_lens.shape[0] + 1}"
        )
    _check_attention(query, key_cache, value_cache, block_tables, context_lens)


def check_out(name: str, out: torch.Tensor, like: torch.Tensor) -> None:
    """An output buffer a kernel writes in place: `like`'s shape, dtype and device, last dim contiguous."""
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        _fail(
            f"{name} must match the query: shape {tuple(like.shape)}, {like.dtype} on {like.device}; "
            f"got {tuple(out.shape)}, {out.dtype} on {out.device}"
        )
    _check_last_dim_contiguous(name, out)


def check_triton_support(kernel: object, key_cache: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Device, dtype, head size and block size limits of the Triton kernels (see support.py).

    `kernel` is the @triton.jit function about to launch (see is_interpreted).
    """
    device = key_cache.device
    for t in tensors:
        if t.device != device:
            _fail(f"all tensors must be on one device; got {t.device} and {device}")
    if device.type == "cpu" and not is_interpreted(kernel):
        _fail(
            "Triton kernels need CUDA tensors; CPU tensors only run with TRITON_INTERPRET=1 "
            "set before triton is imported (use kernels.reference on CPU)"
        )
    if device.type not in ("cuda", "cpu"):
        _fail(f"Triton kernels run on CUDA devices, got {device}")
    dtype = str(key_cache.dtype).removeprefix("torch.")
    if dtype not in support.TRITON_DTYPES:
        _fail(f"Triton kernels support dtypes {sorted(support.TRITON_DTYPES)}, got {dtype}")
    _, block_size, _, head_dim = key_cache.shape
    if head_dim not in support.TRITON_HEAD_SIZES:
        _fail(f"Triton kernels support head sizes {sorted(support.TRITON_HEAD_SIZES)}, got {head_dim}")
    if block_size not in support.TRITON_BLOCK_SIZES:
        _fail(f"Triton kernels support block sizes {sorted(support.TRITON_BLOCK_SIZES)}, got {block_size}")


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` (a @triton.jit function) was made with TRITON_INTERPRET=1 set before
    triton was imported: it then runs on CPU tensors in the interpreter."""
    import triton

    return not isinstance(kernel, triton.runtime.JITFunction)
