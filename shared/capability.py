"""The device/build check: may this worker realize PagedAttention, and with which backend?

A pure function over a description of the device, the build and the model, so every case is testable
on a CPU. The defaults (docs/design.md, "The contract"):

    CUDA + Triton (supported capability, head size, dtype, block size) -> auto enables Triton
    ... whose opt-in shared memory per block cannot hold the kernels'  -> unsupported (component
        tiles for this KV dtype and head size (kernels/support.py)       `kernels`)
    CUDA without a usable Triton                                       -> auto falls back, on fails
    CPU / MPS                                                          -> auto stays eager; on uses torch
    a device map mixing CPU and accelerator layers                     -> unsupported
    --pa-backend triton without CUDA                                   -> unsupported

Every "unsupported" is a shared/reasons.py `Finding` that startup sends through the door (`Ledger.fall_back`),
so `auto` records the reason (with its component and code) and `on` raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpact.shared import reasons
from kvpact.shared.intent import PagedAttentionConfig, PagedBackend
from kvpact.shared.reasons import Finding

ACCELERATOR_KINDS = frozenset({"cuda", "mps"})


@dataclass(frozen=True, slots=True)
class KernelSupport:
    """What the Triton kernels can run (filled from kernels.support by the worker)."""

    head_sizes: frozenset[int]
    block_sizes: frozenset[int]
    dtypes: frozenset[str]
    min_compute_capability: tuple[int, int]
    # ((kv dtype, head size), bytes of shared memory a block of the largest kernel needs); absent = unknown
    shared_memory_bytes: tuple[tuple[tuple[str, int], int], ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The device and build a worker runs on. `device_map_kinds` lists the device kinds layers are
    placed on (empty = every layer on `kind`). `triton_version` is None when Triton is not importable."""

    kind: str  # "cpu", "cuda", "mps"
    name: str = ""
    compute_capability: tuple[int, int] | None = None
    triton_version: str | None = None
    triton_support: KernelSupport | None = None
    device_map_kinds: frozenset[str] = frozenset()
    max_shared_memory_per_block: int | None = None  # opt-in bytes (CUDA); None = unknown


@dataclass(frozen=True, slots=True)
class ModelTraits:
    """Model properties the kernels care about (from the model's config, known before loading weights)."""

    head_size: int
    dtype: str  # the KV cache dtype: "float32", "float16", "bfloat16"


def choose_backend(
    device: DeviceInfo, config: PagedAttentionConfig, required: bool, model: ModelTraits | None
) -> tuple[PagedBackend | None, Finding | None]:
    """The backend PagedAttention runs with here, or (None, why it cannot). Pure; the caller routes
    the finding through the door (the worker's startup check does: worker/startup/checks.py)."""
    kinds = device.device_map_kinds or frozenset({device.kind})
    if "cpu" in kinds and kinds & ACCELERATOR_KINDS:
        return None, reasons.MIXED_DEVICE_MAP.found()
    if config.backend is PagedBackend.TORCH:
        return PagedBackend.TORCH, None
    if config.backend is PagedBackend.TRITON or device.kind == "cuda":
        finding = _triton_unsupported(device, config.block_size, model)
        return (None, finding) if finding else (PagedBackend.TRITON, None)
    # CPU or MPS with backend auto.
    if not required:
        return None, reasons.EAGER_DEFAULT.found(device=device.kind.upper())
    return PagedBackend.TORCH, None


def _triton_unsupported(device: DeviceInfo, block_size: int, model: ModelTraits | None) -> Finding | None:
    """Why the Triton kernels cannot run here, or None when they can."""
    if device.kind != "cuda":
        return reasons.TRITON_OFF_CUDA.found(device=device.kind)
    if device.triton_version is None:
        return reasons.NO_TRITON.found()
    support = device.triton_support
    if support is None:
        return reasons.KERNEL_LIMITS_UNKNOWN.found()
    cc = device.compute_capability
    if cc is None or cc < support.min_compute_capability:
        need = ".".join(map(str, support.min_compute_capability))
        have = ".".join(map(str, cc)) if cc else "unknown"
        name = device.name or "this GPU"
        return reasons.COMPUTE_CAPABILITY.found(need=need, gpu=name, have=have)
    if block_size not in support.block_sizes:
        sizes = ", ".join(map(str, sorted(support.block_sizes)))
        return reasons.BLOCK_SIZE.found(sizes=sizes, block_size=block_size)
    if model is not None and model.head_size not in support.head_sizes:
        sizes = ", ".join(map(str, sorted(support.head_sizes)))
        return reasons.HEAD_SIZE.found(head_size=model.head_size, sizes=sizes)
    if model is not None and model.dtype not in support.dtypes:
        dtypes = ", ".join(sorted(support.dtypes))
        return reasons.KV_DTYPE.found(dtypes=dtypes, dtype=model.dtype)
    need_bytes = dict(support.shared_memory_bytes).get((model.dtype, model.head_size)) if model else None
    have_bytes = device.max_shared_memory_per_block
    if model is not None and need_bytes is not None and have_bytes is not None and need_bytes > have_bytes:
        return reasons.SHARED_MEMORY.found(
            need=need_bytes,
            dtype=model.dtype,
            head_size=model.head_size,
            gpu=device.name or "this GPU",
            have=have_bytes,
        )
    return None
