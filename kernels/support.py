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


def triton_version() -> str | None:
    """The installed Triton version, or None when triton cannot be imported."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__
