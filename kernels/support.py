"""What the Triton kernels support, as plain data (the worker's capability check reads this).

Every value here is exercised by tests/kernels (default grid or the `slow` grid).
"""

# Head dims are padded to the next power of two and masked, so any size >= 16 (tl.dot's minimum
# inner dimension) works in principle; these are the ones the tests run.
TRITON_HEAD_SIZES: frozenset[int] = frozenset({32, 64, 80, 96, 128, 256})

# The kernels gather K/V token by token through the block table, so the tile size does not depend
# on the cache block size; these are the block sizes the tests run.
TRITON_BLOCK_SIZES: frozenset[int] = frozenset({8, 16, 32, 64})

TRITON_DTYPES: frozenset[str] = frozenset({"float16", "bfloat16", "float32"})

# (8, 0) = Ampere: the bf16 path feeds bf16 tiles to tl.dot, and bf16 tensor-core MMA needs sm_80.
# Compile for older targets is not tested.
TRITON_MIN_COMPUTE_CAPABILITY: tuple[int, int] = (8, 0)


# Shared memory one block of the largest paged kernel needs, per (KV dtype, head size) and
# architecture, with the default tiles (prefill: BLOCK_M 64 query rows x TILE 32 tokens, num_warps 4).
# The cache block size does not enter: tokens are gathered one by one through the block table. The
# prefill dominates: its software-pipelined K and V tiles (stages x 2 x TILE x padded head x element
# size; Triton pipelines 2 deep, 3 for 16-bit tiles on sm_90), the P tile's layout conversion
# (BLOCK_M x TILE x element size) and a few hundred bytes of scratch. Compile-only with Triton 3.9's
# ptxas this equals compiled.metadata.shared for fp32 x 256 (139,648 B on sm_86 and sm_90) and
# fp32 x 128 (74,112 B, sm_80) and bounds the 16-bit figures (bf16 x 128: 36,992 B on sm_80/86/89,
# 49,280 B on sm_90); tests/kernels/triton_cases.py (cuda_compile) checks the bound for sm_80/86/89/90.
# The capability decision compares it with the device's opt-in shared memory per block (A100: 163 KB,
# H100: 227 KB; A10G, L4, L40S, RTX 3090/4090: 99 KB).
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def shared_memory_bytes(dtype: str, head_size: int, compute_capability: tuple[int, int] = (8, 0)) -> int:
    """The shared memory per block the paged kernels need for this KV dtype, head size and GPU (above)."""
    pad, element = 1 << (head_size - 1).bit_length(), _ELEMENT_BYTES[dtype]
    stages = 3 if compute_capability >= (9, 0) and element == 2 else 2
    return stages * 2 * 32 * pad * element + 64 * 32 * element + 384


def shared_memory_table(compute_capability: tuple[int, int]) -> dict[tuple[str, int], int]:
    """shared_memory_bytes for every supported (dtype, head size) on one architecture."""
    return {
        (dtype, head): shared_memory_bytes(dtype, head, compute_capability)
        for dtype in TRITON_DTYPES
        for head in TRITON_HEAD_SIZES
    }


def triton_version() -> str | None:
    """The installed Triton version, or None when triton cannot be imported."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
