"""kernels.support is plain data the worker's capability check reads without importing triton."""

from kvpact.kernels import support


def test_support_is_plain_data():
    assert isinstance(support.TRITON_HEAD_SIZES, frozenset) and {64, 128} <= support.TRITON_HEAD_SIZES
    assert isinstance(support.TRITON_BLOCK_SIZES, frozenset) and {16, 32} <= support.TRITON_BLOCK_SIZES
    assert support.TRITON_DTYPES == frozenset({"float16", "bfloat16", "float32"})
    assert support.TRITON_MIN_COMPUTE_CAPABILITY == (8, 0)
    assert all(isinstance(n, int) for n in support.TRITON_HEAD_SIZES | support.TRITON_BLOCK_SIZES)
