"""How many Triton kernel variants this process has compiled (the worker counts those after ready).

Reads Triton's own per-device JIT caches of the paged kernels; never imports triton (a module not
yet imported has compiled nothing). Under TRITON_INTERPRET=1 nothing compiles: always 0.
"""

import sys

_KERNELS = {
    "kvpact.kernels.cache_write": ("kernel_reshape_and_cache",),
    "kvpact.kernels.decode_attention": ("kernel_paged_decode_attention", "kernel_merge_splits"),
    "kvpact.kernels.prefill_attention": ("kernel_paged_prefill_attention",),
}


def compiled_variant_count() -> int:
    """Compiled variants of the paged kernels in Triton's JIT caches, over every device."""
    total = 0
    for module_name, names in _KERNELS.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            caches = getattr(getattr(module, name), "device_caches", None) or {}
            total += sum(len(entry[0]) for entry in caches.values())
    return total
