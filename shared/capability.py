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

Every "unsupported" goes through `disable_paged_attention`, so `auto` records the reason and `on` raises;
the messages are shared/reasons.py's (component `device`; `kernels` for shared memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpact.shared import reasons
from kvpact.shared.intent import PagedAttentionState, PagedBackend, disable_paged_attention

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


@dataclass(frozen=True, slots=True)
class PagedDecision:
    enabled: bool
    required: bool
    backend: PagedBackend | None
    reason: str  # why it is off ("" when enabled)


def decide_paged_attention(
    device: DeviceInfo, state: PagedAttentionState, model: ModelTraits | None = None
) -> PagedDecision:
    """Decide, and route any impossibility through the fallback door (which raises under `on`)."""
    if state.intent.paged is None:
        return PagedDecision(enabled=False, required=False, backend=None, reason="--paged-attn off")
    if state.paged_config is None:  # an earlier component already fell back
        return PagedDecision(enabled=False, required=False, backend=None, reason=state.fallbacks[-1].reason)
    backend, reason = _choose_backend(device, state, model)
    if backend is None:
        # A GPU too small for the kernels' tiles is the kernels' limit; everything else the device's.
        component = reasons.SHARED_MEMORY.component if _is_shared_memory(reason) else "device"
        disable_paged_attention(state, reason, component=component)
        return PagedDecision(enabled=False, required=False, backend=None, reason=reason)
    return PagedDecision(enabled=True, required=state.required, backend=backend, reason="")


def _choose_backend(
    device: DeviceInfo, state: PagedAttentionState, model: ModelTraits | None
) -> tuple[PagedBackend | None, str]:
    config = state.paged_config
    assert config is not None
    kinds = device.device_map_kinds or frozenset({device.kind})
    if "cpu" in kinds and kinds & ACCELERATOR_KINDS:
        return None, reasons.MIXED_DEVICE_MAP.message()
    if config.backend is PagedBackend.TORCH:
        return PagedBackend.TORCH, ""
    if config.backend is PagedBackend.TRITON or device.kind == "cuda":
        reason = _triton_unsupported(device, config.block_size, model)
        return (None, reason) if reason else (PagedBackend.TRITON, "")
    # CPU or MPS with backend auto.
    if not config.required:
        return None, reasons.EAGER_DEFAULT.message(device=device.kind.upper())
    return PagedBackend.TORCH, ""


def _triton_unsupported(device: DeviceInfo, block_size: int, model: ModelTraits | None) -> str:
    """Why the Triton kernels cannot run here, or "" when they can."""
    if device.kind != "cuda":
        return reasons.TRITON_OFF_CUDA.message(device=device.kind)
    if device.triton_version is None:
        return reasons.NO_TRITON.message()
    support = device.triton_support
    if support is None:
        return reasons.KERNEL_LIMITS_UNKNOWN.message()
    cc = device.compute_capability
    if cc is None or cc < support.min_compute_capability:
        need = ".".join(map(str, support.min_compute_capability))
        have = ".".join(map(str, cc)) if cc else "unknown"
        name = device.name or "this GPU"
        return reasons.COMPUTE_CAPABILITY.message(need=need, gpu=name, have=have)
    if block_size not in support.block_sizes:
        sizes = ", ".join(map(str, sorted(support.block_sizes)))
        return reasons.BLOCK_SIZE.message(sizes=sizes, block_size=block_size)
    if model is not None and model.head_size not in support.head_sizes:
        sizes = ", ".join(map(str, sorted(support.head_sizes)))
        return reasons.HEAD_SIZE.message(head_size=model.head_size, sizes=sizes)
    if model is not None and model.dtype not in support.dtypes:
        dtypes = ", ".join(sorted(support.dtypes))
        return reasons.KV_DTYPE.message(dtypes=dtypes, dtype=model.dtype)
    need_bytes = dict(support.shared_memory_bytes).get((model.dtype, model.head_size)) if model else None
    have_bytes = device.max_shared_memory_per_block
    if model is not None and need_bytes is not None and have_bytes is not None and need_bytes > have_bytes:
        return reasons.SHARED_MEMORY.message(
            need=need_bytes,
            dtype=model.dtype,
            head_size=model.head_size,
            gpu=device.name or "this GPU",
            have=have_bytes,
        )
    return ""


def _is_shared_memory(reason: str) -> bool:
    return reason.startswith(reasons.SHARED_MEMORY.template.split("{", 1)[0]) and "shared memory" in reason
