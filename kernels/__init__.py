"""Paged-attention kernels: Triton (CUDA, or CPU under TRITON_INTERPRET=1) and pure-torch references.

`import kvpact.kernels`, `kvpact.kernels.reference` and `kvpact.kernels.support` never import triton.
The Triton functions are loaded on first access (`from kvpact.kernels import paged_decode_attention`),
which raises ImportError when triton is not installed; check `kvpact.kernels.support.triton_version()` first.
"""

from typing import Any

from kvpact.kernels.reference import (
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
    reshape_and_cache_torch,
)
from kvpact.kernels.support import (
    TRITON_BLOCK_SIZES,
    TRITON_DTYPES,
    TRITON_HEAD_SIZES,
    TRITON_MIN_COMPUTE_CAPABILITY,
    triton_version,
)

_TRITON_FUNCTIONS = {
    "reshape_and_cache": "kvpact.kernels.cache_write",
    "paged_decode_attention": "kvpact.kernels.decode_attention",
    "paged_prefill_attention": "kvpact.kernels.prefill_attention",
}

__all__ = [
    "TRITON_BLOCK_SIZES",
    "TRITON_DTYPES",
    "TRITON_HEAD_SIZES",
    "TRITON_MIN_COMPUTE_CAPABILITY",
    "paged_decode_attention",
    "paged_decode_attention_torch",
    "paged_prefill_attention",
    "paged_prefill_attention_torch",
    "reshape_and_cache",
    "reshape_and_cache_torch",
    "triton_version",
]


def __getattr__(name: str) -> Any:
    if name not in _TRITON_FUNCTIONS:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_TRITON_FUNCTIONS[name]), name)
