"""Triton kernels against the torch references.

Not collected directly (no test_ prefix): test_triton_kernels.py runs this file in a
subprocess, under TRITON_INTERPRET=1 when there is no CUDA device, so that an out-of-bounds
access that crashes the interpreter fails one test instead of the whole session. On a GPU
machine run it directly, compiled (the native bf16 tl.dot path runs only there):

    KVPACT_KERNEL_DEVICE=cuda pytest tests/kernels/triton_cases.py -m '' -k 'not cuda_compile'

KVPACT_KERNEL_DEVICE: `cuda` (every case on the GPU; an error, not a skip, when there is none or
TRITON_INTERPRET is set), `cpu` (interpreter only), unset: CUDA when available, else the CPU.

Groups (selected with -k): cache_write, decode, prefill, checks, cuda_compile.
"""

import itertools
import os

import pytest
import torch

from kvpact.kernels import reference
from tests.kernels.factory import make_paged_batch, make_queries, query_start_loc

DEVICE_ENV = "KVPACT_KERNEL_DEVICE"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device() -> str:
    wanted = os.environ.get(DEVICE_ENV, "")
    if wanted == "cuda":
        if not torch.cuda.is_available() or INTERPRETED:
            raise RuntimeError(
                f"{DEVICE_ENV}=cuda, but torch sees no CUDA device or TRITON_INTERPRET=1 is set "
                f"(torch {torch.__version__}, cuda available: {torch.cuda.is_available()})"
            )
        return "cuda"
    if wanted not in ("", "cpu"):
        raise RuntimeError(f"{DEVICE_ENV} must be cuda or cpu, got {wanted!r}")
    return "cuda" if torch.cuda.is_available() and wanted != "cpu" else "cpu"


DEVICE = kernel_device()
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETED, reason="no CUDA device and TRITON_INTERPRET is not 1"
)

# |triton - reference| <= atol + rtol * |reference|, compared in fp32. The references accumulate
# in fp32 and round once; the kernels also round P to the input dtype before P @ V (fp16/bf16).
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = list(TOLERANCES)
LOW_PRECISION = [torch.float16, torch.bfloat16]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pairwise(**axes: list) -> list:
    """Every combination of `axes` as pytest params, in product order: a covering set (every pair of values
    of two axes appears in at least one case) runs by default, the other cases are marked slow (make
    test-all, and the `*_slow` tests of test_triton_kernels.py, run them). A bug that needs two parameters
    to show still fails in the default run, at a fraction of the interpreter's time."""
    names = list(axes)
    combos = list(itertools.product(*axes.values()))

    def pairs(combo: tuple) -> set:
        return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(names)), 2)}

    uncovered = set().union(*(pairs(c) for c in combos))
    chosen = set()
    while uncovered:  # greedy: the case that covers most of what is left (first in product order on ties)
        best = max(combos, key=lambda c: len(pairs(c) & uncovered))
        chosen.add(best)
        uncovered -= pairs(best)

    def case_id(combo: tuple) -> str:
        return "-".join(dtype_id(v) if isinstance(v, torch.dtype) else str(v) for v in combo)

    return [pytest.param(*c, id=case_id(c), marks=() if c in chosen else pytest.mark.slow) for c in combos]


KV_HEADS = 2


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[expected.dtype])


def run_decode(lens, *, head_dim, group, block_size, dtype, num_splits):
    from kvpact.kernels import paged_decode_attention

    batch = make_paged_batch(
        lens, block_size=block_size, kv_heads=KV_HEADS, head_dim=head_dim, dtype=dtype, device=DEVICE
    )
    query = make_queries(len(lens), KV_HEADS * group, head_dim, dtype, DEVICE)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, head_dim**-0.5)
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert_matches(out, reference.paged_decode_attention_torch(*args))


def run_prefill(seqs, *, head_dim, group, block_size, dtype):
    from kvpact.kernels import paged_prefill_attention

    lens = [p + n for p, n in seqs]
    q_lens = [n for _, n in seqs]
    batch = make_paged_batch(
        lens, block_size=block_size, kv_heads=KV_HEADS, head_dim=head_dim, dtype=dtype, device=DEVICE
    )
    query = make_queries(sum(q_lens), KV_HEADS * group, head_dim, dtype, DEVICE)
    args = (
        query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        query_start_loc(q_lens, DEVICE),
        batch.context_lens,
        head_dim**-0.5,
    )
    assert_matches(paged_prefill_attention(*args), reference.paged_prefill_attention_torch(*args))


# ---- cache_write ---------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 32)])
def test_cache_write_matches_reference_and_skips_padding(dtype, head_dim, block_size):
    from kvpact.kernels import reshape_and_cache

    batch = make_paged_batch(
        [1, block_size, block_size + 1],
        block_size=block_size,
        kv_heads=3,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
    )
    pad = torch.tensor([-1], device=DEVICE)
    slots = torch.cat([pad, *batch.slot_mappings, pad])
    garbage = torch.full((1, 3, head_dim), 7.0, dtype=dtype, device=DEVICE)
    key = torch.cat([garbage, *batch.keys, garbage])
    value = torch.cat([garbage, *batch.values, -garbage])
    key_cache = torch.full_like(batch.key_cache, float("nan"))
    value_cache = torch.full_like(batch.value_cache, float("nan"))
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    # The factory wrote the same tokens into the same slots and left the rest NaN.
    torch.testing.assert_close(key_cache, batch.key_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, batch.value_cache, atol=0, rtol=0, equal_nan=True)


@needs_kernels
def test_cache_write_accepts_strided_key_value():
    from kvpact.kernels import reshape_and_cache

    batch = make_paged_batch([20], block_size=16, kv_heads=2, head_dim=64, dtype=torch.float16, device=DEVICE)
    qkv = torch.cat([batch.keys[0], batch.keys[0], batch.values[0]], dim=1)  # fused-projection layout
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    key_cache = torch.full_like(batch.key_cache, float("nan"))
    value_cache = torch.full_like(batch.value_cache, float("nan"))
    reshape_and_cache(key, value, key_cache, value_cache, batch.slot_mappings[0])
    torch.testing.assert_close(key_cache, batch.key_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, batch.value_cache, atol=0, rtol=0, equal_nan=True)


# ---- decode --------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize(
    "head_dim, group, block_size, dtype",
    pairwise(head_dim=[64, 128], group=[1, 4, 8], block_size=[16, 32], dtype=DTYPES),
)
def test_decode_matches_reference(head_dim, group, block_size, dtype):
    # 1 token, exactly a block, a block + 1, and 4 tiles: with 3 splits that is 2 + 2 + empty.
    lens = [1, block_size, block_size + 1, 101]
    for num_splits in (1, 3):
        run_decode(
            lens, head_dim=head_dim, group=group, block_size=block_size, dtype=dtype, num_splits=num_splits
        )


@needs_kernels
@pytest.mark.parametrize("num_splits", [None, 2, 5, 8])
def test_decode_split_counts(num_splits):
    run_decode(
        [200, 7, 64, 129], head_dim=64, group=4, block_size=16, dtype=torch.float16, num_splits=num_splits
    )


def fused_qkv_batch():
    """A query that is a slice of a fused QKV projection: token stride != q_heads * head_dim."""
    batch = make_paged_batch(
        [3, 40], block_size=16, kv_heads=2, head_dim=64, dtype=torch.float16, device=DEVICE
    )
    qkv = make_queries(2, 8 + 2 + 2, 64, torch.float16, DEVICE)
    return batch, qkv[:, :8]


@needs_kernels
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_accepts_strided_query(num_splits):
    from kvpact.kernels import paged_decode_attention

    batch, query = fused_qkv_batch()
    cache = (batch.key_cache, batch.value_cache, batch.block_tables)
    out = paged_decode_attention(query, *cache, batch.context_lens, 0.125, num_splits=num_splits)
    assert_matches(
        out, reference.paged_decode_attention_torch(query.contiguous(), *cache, batch.context_lens, 0.125)
    )


@needs_kernels
def test_decode_default_num_splits_is_a_power_of_two_within_the_heuristic():
    from kvpact.kernels.decode_attention import MAX_SPLITS, choose_num_splits, default_num_splits

    seen = set()
    for num_seqs in (1, 2, 3, 16, 64, 256):
        for context in (1, 100, 512, 2048, 5000, 8192, 100_000):
            wanted = choose_num_splits(num_seqs, 8, context, 132)
            got = default_num_splits(num_seqs, 8, context, 132)
            assert got & (got - 1) == 0 and wanted / 2 < got < 2 * wanted and got <= MAX_SPLITS
            seen.add(got)
    assert seen == {1, 2, 4, 8, 16, 32}  # six decode kernels at most, however long contexts grow


@needs_kernels
def test_decode_choose_num_splits():
    from kvpact.kernels.decode_attention import MAX_SPLITS, choose_num_splits

    assert choose_num_splits(num_seqs=256, kv_heads=8, max_context_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, kv_heads=8, max_context_len=8192, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(num_seqs=1, kv_heads=8, max_context_len=512, num_sms=132) == 4  # 16 tiles / 4
    assert choose_num_splits(num_seqs=16, kv_heads=8, max_context_len=2048, num_sms=132) == 5  # 528 / 128
    assert choose_num_splits(num_seqs=1, kv_heads=8, max_context_len=1, num_sms=132) == 1


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_decode_other_head_sizes(head_dim, dtype):
    for num_splits in (1, 2):
        run_decode(
            [1, 16, 17, 70], head_dim=head_dim, group=4, block_size=16, dtype=dtype, num_splits=num_splits
        )


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("block_size", [8, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_other_block_sizes(block_size, dtype):
    for num_splits in (1, 3):
        run_decode(
            [1, block_size, block_size + 1, 150],
            head_dim=64,
            group=4,
            block_size=block_size,
            dtype=dtype,
            num_splits=num_splits,
        )


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
def test_decode_long_contexts(dtype):
    lens = [1, 511, 512, 513, 1000, 1024]
    for num_splits in (1, 7, 16):
        run_decode(lens, head_dim=128, group=4, block_size=16, dtype=dtype, num_splits=num_splits)


# ---- prefill -------------------------------------------------------------------------------

# (cached prefix, new tokens) per sequence
PREFILL_BATCHES = {
    "no_prefix": [(0, 1), (0, 16), (0, 17), (0, 70)],
    "with_prefix": [(16, 1), (32, 5), (31, 40)],
}


@needs_kernels
@pytest.mark.parametrize(
    "name, head_dim, group, block_size, dtype",
    pairwise(
        name=sorted(PREFILL_BATCHES), head_dim=[64, 128], group=[1, 4, 8], block_size=[16, 32], dtype=DTYPES
    ),
)
def test_prefill_matches_reference(name, head_dim, group, block_size, dtype):
    run_prefill(PREFILL_BATCHES[name], head_dim=head_dim, group=group, block_size=block_size, dtype=dtype)


@needs_kernels
def test_prefill_accepts_strided_query():
    from kvpact.kernels import paged_prefill_attention

    batch, query = fused_qkv_batch()
    args = (
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        query_start_loc([1, 1], DEVICE),
        batch.context_lens,
    )
    out = paged_prefill_attention(query, *args, 0.125)
    assert_matches(out, reference.paged_prefill_attention_torch(query.contiguous(), *args, 0.125))


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=dtype_id)
@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_prefill_other_head_sizes(head_dim, dtype):
    run_prefill([(0, 20), (17, 30)], head_dim=head_dim, group=4, block_size=16, dtype=dtype)


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("block_size", [8, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_other_block_sizes(block_size, dtype):
    run_prefill(
        [(0, 1), (block_size, 1), (block_size + 3, 40), (0, 100)],
        head_dim=64,
        group=4,
        block_size=block_size,
        dtype=dtype,
    )


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("group", [1, 8])
def test_prefill_long_prompts(group):
    run_prefill(
        [(0, 300), (250, 80), (500, 1)], head_dim=128, group=group, block_size=16, dtype=torch.float16
    )


# ---- checks --------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize(
    "head_dim, block_size, dtype, message",
    [
        (48, 16, torch.float16, "support head sizes"),
        (64, 12, torch.float16, "support block sizes"),
    ],
)
def test_checks_reject_unsupported_shapes(head_dim, block_size, dtype, message):
    from kvpact.kernels import paged_decode_attention, paged_prefill_attention

    batch = make_paged_batch(
        [5], block_size=block_size, kv_heads=2, head_dim=head_dim, dtype=dtype, device=DEVICE
    )
    query = make_queries(1, 2, head_dim, dtype, DEVICE)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(*args, batch.context_lens, 0.125)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(*args, query_start_loc([1], DEVICE), batch.context_lens, 0.125)


def test_checks_triton_version_is_the_installed_one():
    import triton

    from kvpact.kernels.support import triton_version

    assert triton_version() == triton.__version__


@needs_kernels
def test_checks_reject_bad_arguments_before_launch():
    from kvpact.kernels import paged_decode_attention, reshape_and_cache

    batch = make_paged_batch([5], block_size=16, kv_heads=2, head_dim=64, dtype=torch.float16, device=DEVICE)
    query = make_queries(1, 8, 64, torch.float16, DEVICE)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        paged_decode_attention(
            query, batch.key_cache, batch.value_cache, batch.block_tables.long(), batch.context_lens, 0.125
        )
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_decode_attention(
            query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.context_lens,
            0.125,
            num_splits=0,
        )
    with pytest.raises(ValueError, match="key dtype torch.float32 != cache dtype"):
        reshape_and_cache(
            batch.keys[0].float(), batch.values[0], batch.key_cache, batch.value_cache, batch.slot_mappings[0]
        )


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled (not interpreted) kernels")
def test_checks_reject_cpu_tensors_without_interpreter():
    from kvpact.kernels import paged_decode_attention

    batch = make_paged_batch([5], block_size=16, kv_heads=2, head_dim=64, dtype=torch.float16)
    query = make_queries(1, 8, 64, torch.float16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        paged_decode_attention(
            query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, 0.125
        )


# ---- cuda_compile: the real GPU compiler (through ptxas), no GPU needed ----------------------

# Opt-in shared memory per block (bytes) by architecture: A100; A10G/RTX 3090; L4/L40S/RTX 4090; H100.
MAX_SHARED = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
# The integer arguments the runtime specializes as divisible by 16 (Triton keys ints on % 16 and pointers
# on 16-byte alignment): every pointer and cache/query/output stride; not stride_block_tables_seq
# (do_not_specialize) nor the scalars.
NOT_DIVISIBLE = {"scale", "stride_block_tables_seq"}


def compile_for_cuda(kernel, pointer_types: dict[str, str], constexprs: dict, arch: int) -> dict[str, int]:
    """Compile like a launch would (same signature and divisibility hints); returns the resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        name: "constexpr"
        if name in constexprs
        else pointer_types.get(name, "fp32" if name == "scale" else "i32")
        for name in kernel.arg_names
    }
    hints = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name not in constexprs and name not in NOT_DIVISIBLE and name not in kernel.do_not_specialize
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs, attrs=hints),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": 4},
    )
    return {"shared": compiled.metadata.shared, **cubin_resources(compiled.asm["cubin"])}


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers and stack (spill) bytes per thread, from Triton's bundled cuobjdump."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert found, out
    return {"registers": int(found.group(1)), "stack": int(found.group(2))}


def attention_pointers(dtype: str) -> dict[str, str]:
    return {
        "query_ptr": dtype,
        "key_cache_ptr": dtype,
        "value_cache_ptr": dtype,
        "block_tables_ptr": "*i32",
        "context_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32",
        "lse_ptr": "*fp32",
    }


def compile_all(head_dim: int, dtype: str, group: int, arch: int) -> dict[str, dict[str, int]]:
    """Every kernel for one shape and architecture; each must fit the architecture's shared memory,
    or, where it cannot, the capability decision must say so before loading (kernels/support.py)."""
    import triton

    from kvpact.kernels.cache_write import kernel_reshape_and_cache
    from kvpact.kernels.decode_attention import kernel_merge_splits, kernel_paged_decode_attention
    from kvpact.kernels.prefill_attention import BLOCK_M, kernel_paged_prefill_attention
    from kvpact.kernels.support import shared_memory_bytes

    pad = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    common = dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, BLOCK_SIZE=16, QUERY_GROUP=group, TILE=32, COMPUTE_FP32=False
    )
    got = {}
    for splits, out in ((1, dtype), (4, "*fp32")):
        got[f"decode splits={splits}"] = compile_for_cuda(
            kernel_paged_decode_attention,
            {**attention_pointers(dtype), "out_ptr": out},
            dict(common, GROUP_PAD=max(16, group_pad), NUM_SPLITS=splits),
            arch,
        )
    got["merge"] = compile_for_cuda(
        kernel_merge_splits,
        {"out_ptr": dtype, "partial_ptr": "*fp32", "lse_ptr": "*fp32"},
        dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, NUM_SPLITS=4, SPLITS_PAD=4),
        arch,
    )
    got["prefill"] = compile_for_cuda(
        kernel_paged_prefill_attention,
        {**attention_pointers(dtype), "out_ptr": dtype},
        dict(common, GROUP_PAD=group_pad, BLOCK_Q=max(1, BLOCK_M // group_pad)),
        arch,
    )
    got["reshape_and_cache"] = compile_for_cuda(
        kernel_reshape_and_cache,
        {p: dtype for p in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
        | {"slot_mapping_ptr": "*i64"},
        dict(KV_HEADS=3, KV_HEADS_PAD=4, HEAD_DIM=head_dim, HEAD_DIM_PAD=pad, BLOCK_SIZE=16),
        arch,
    )
    kv_dtype = {"*fp16": "float16", "*bf16": "bfloat16", "*fp32": "float32"}[dtype]
    need = shared_memory_bytes(kv_dtype, head_dim, divmod(arch, 10))
    for name, resources in got.items():
        print(f"sm_{arch} {dtype[1:]} head {head_dim} {name}: {resources}")
        assert resources["shared"] <= need, (name, resources, need)  # the support table bounds it
        assert resources["shared"] <= MAX_SHARED[arch] or need > MAX_SHARED[arch], (name, resources)
    return got


cuda_compiler = pytest.mark.skipif(INTERPRETED, reason="the interpreter has no compiler")


@cuda_compiler
@pytest.mark.parametrize(
    ("arch", "dtype"),
    [
        (90, "*bf16"),  # Hopper (the H200 gpu_check.sh runs on)
        (80, "*fp32"),
        *(
            pytest.param(a, d, marks=pytest.mark.slow)
            for a, d in [(80, "*bf16"), (86, "*bf16"), (89, "*fp16")]
        ),
    ],
)
def test_cuda_compile(arch, dtype):
    got = compile_all(128, dtype, group=4, arch=arch)
    assert got["decode splits=1"]["stack"] == 0  # the decode, the serving hot path, does not spill


@pytest.mark.slow
@cuda_compiler
@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@pytest.mark.parametrize("dtype", ["*fp16", "*bf16", "*fp32"])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 256])
def test_cuda_compile_all_head_sizes(head_dim, dtype, arch):
    compile_all(head_dim, dtype, group=8, arch=arch)
