"""The CPU C kernels (kernels/cpu_paged.py) against the references and textbook attention, and the
reasons they give when they cannot run."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvpact.kernels import cpu_paged
from kvpact.kernels.reference import (
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
    reshape_and_cache_torch,
)
from tests.kernels.factory import dense_attention, make_paged_batch, make_queries, query_start_loc

KV_HEADS = 2


# Without a C compiler the worker falls back to the references (and says so); with one, the build
# must succeed.
pytestmark = pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"
)


@pytest.fixture(scope="module")
def ops() -> cpu_paged.CpuPagedOps:
    loaded = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(loaded, str), loaded
    return loaded


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_equals_the_reference_and_dense_attention_and_never_reads_a_poisoned_slot(
    ops, head_dim, group, block_size
):
    # The factory fills every slot no sequence owns with NaN: one read past a context shows as NaN.
    lens = [1, block_size, block_size + 1, 3 * block_size + 5, 200]
    batch = make_paged_batch(
        lens, block_size=block_size, kv_heads=KV_HEADS, head_dim=head_dim, dtype=torch.float32
    )
    query = make_queries(len(lens), KV_HEADS * group, head_dim, torch.float32)
    scale = head_dim**-0.5
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, scale)
    out = torch.full_like(query, float("nan"))
    got = ops.decode(*args, out=out)
    assert got is out
    torch.testing.assert_close(got, paged_decode_attention_torch(*args), atol=1e-5, rtol=1e-5)
    for i in range(len(lens)):
        want = dense_attention(query[i : i + 1], batch.keys[i], batch.values[i], scale)[0]
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_split_over_threads_equals_one_thread():
    # Large enough that the kernel splits the (sequence, kv head) pairs over threads.
    lens = [300, 17, 450, 1, 260, 333, 128, 90]
    batch = make_paged_batch(lens, block_size=16, kv_heads=KV_HEADS, head_dim=64, dtype=torch.float32)
    query = make_queries(len(lens), KV_HEADS * 4, 64, torch.float32)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, 0.125)
    one = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(one, str)
    single = cpu_paged.CpuPagedOps(one.library, one.path, num_threads=1).decode(*args)
    many = cpu_paged.CpuPagedOps(one.library, one.path, num_threads=4).decode(*args)
    assert torch.equal(single, many)
    torch.testing.assert_close(many, paged_decode_attention_torch(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_equals_the_reference_with_and_without_a_cached_prefix(ops, group):
    lens, query_lens = [5, 40, 33, 1], [5, 7, 33, 1]  # full prompt, extend after a prefix, full, one
    batch = make_paged_batch(lens, block_size=16, kv_heads=KV_HEADS, head_dim=32, dtype=torch.float32)
    query = make_queries(sum(query_lens), KV_HEADS * group, 32, torch.float32)
    starts = query_start_loc(query_lens)
    args = (query, batch.key_cache, batch.value_cache, batch.block_tables, starts, batch.context_lens, 0.2)
    got = ops.prefill(*args)
    torch.testing.assert_close(got, paged_prefill_attention_torch(*args), atol=1e-5, rtol=1e-5)
    for i, (n, q_len) in enumerate(zip(lens, query_lens, strict=True)):
        a, b = int(starts[i]), int(starts[i + 1])
        want = dense_attention(query[a:b], batch.keys[i], batch.values[i], 0.2)
        torch.testing.assert_close(got[a:b].double(), want, atol=1e-5, rtol=1e-5)
        assert b - a == q_len and n >= q_len
    # Given the new tokens' own K/V, a chunk with no cached prefix attends on them and reads no block: with
    # every block poisoned, those chunks are unchanged and only the extend (7 of 40) turns NaN.
    key = torch.cat([batch.keys[i][-q:] for i, q in enumerate(query_lens)])
    value = torch.cat([batch.values[i][-q:] for i, q in enumerate(query_lens)])
    own = ops.prefill(*args, key=key, value=value)
    torch.testing.assert_close(own, got, atol=1e-5, rtol=1e-5)
    poisoned = (query, batch.key_cache.clone().fill_(float("nan")), *args[2:])
    blind = ops.prefill(*poisoned, key=key, value=value)
    nan_rows = [int(i) for i in blind.isnan().any(-1).any(-1).nonzero().flatten()]
    assert nan_rows == list(range(int(starts[1]), int(starts[2])))


def test_prefill_reads_an_ascending_run_of_blocks_in_place_and_a_scattered_table_by_gather(ops):
    lens, query_lens = [40, 37, 20], [7, 5, 20]  # two extends after a prefix, one full prompt
    batch = make_paged_batch(lens, block_size=16, kv_heads=KV_HEADS, head_dim=32, dtype=torch.float32)
    query = make_queries(sum(query_lens), KV_HEADS * 2, 32, torch.float32)
    starts = query_start_loc(query_lens)
    want = ops.prefill(
        query, batch.key_cache, batch.value_cache, batch.block_tables, starts, batch.context_lens, 0.2
    )
    # Sequence 0's three blocks move to one ascending run past the old pool's end (its old blocks, and
    # every block nobody owns, NaN); sequences 1 and 2 keep their scattered tables.
    old = batch.key_cache.shape[0]
    key_cache = torch.cat([batch.key_cache, torch.full_like(batch.key_cache[:4], float("nan"))])
    value_cache = torch.cat([batch.value_cache, torch.full_like(batch.value_cache[:4], float("nan"))])
    tables = batch.block_tables.clone()
    moved = tables[0, :3].long()
    for pool in (key_cache, value_cache):
        pool[old + 1 : old + 4] = pool[moved]
        pool[moved] = float("nan")
    tables[0, :3] = torch.arange(old + 1, old + 4, dtype=torch.int32)
    got = ops.prefill(query, key_cache, value_cache, tables, starts, batch.context_lens, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        got,
        paged_prefill_attention_torch(query, key_cache, value_cache, tables, starts, batch.context_lens, 0.2),
        atol=1e-5,
        rtol=1e-5,
    )


def test_write_equals_the_reference_and_skips_negative_slots(ops):
    torch.manual_seed(0)
    caches = [torch.zeros(6, 4, KV_HEADS, 8) for _ in range(4)]
    key, value = torch.randn(5, KV_HEADS, 8), torch.randn(5, KV_HEADS, 8)
    slots = torch.tensor([3, -1, 22, 0, 9], dtype=torch.int64)
    ops.write(key, value, caches[0], caches[1], slots)
    reshape_and_cache_torch(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 4  # the -1 row went nowhere


# ---- a bfloat16 cache: float32 in and out, stored rounded ----


def test_a_bfloat16_cache_is_written_as_torch_rounds_float32_to_bfloat16(ops):
    # Ties to even both ways, values that round up into the next binade and to infinity, infinities,
    # NaN, signed zero, a denormal, and random rows; slot -1 skipped.
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001]
    bits += [0xFFA00000, 0x80000000, 0x00000001, 0x3FFFFFFF, 0xBF7FC000, 0x40490FDB, 0xC2F6E979, 0x00800000]
    special = (
        torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32).reshape(1, KV_HEADS, 8)
    )
    key = torch.cat([special, torch.randn(4, KV_HEADS, 8, generator=torch.Generator().manual_seed(1))])
    value = torch.cat([torch.randn(4, KV_HEADS, 8, generator=torch.Generator().manual_seed(2)), -special])
    slots = torch.tensor([3, -1, 22, 0, 9], dtype=torch.int64)
    got = [torch.zeros(6, 4, KV_HEADS, 8, dtype=torch.bfloat16) for _ in range(2)]
    want = [t.clone() for t in got]
    ops.write(key, value, *got, slots)
    reshape_and_cache_torch(key.bfloat16(), value.bfloat16(), *want, slots)
    for g, w in zip(got, want, strict=True):  # bit for bit, but a NaN's (torch's vector path sets them all)
        nan = w.isnan()
        assert torch.equal(g.isnan(), nan) and int(nan.sum()) == 2
        assert torch.equal(g.view(torch.int16)[~nan], w.view(torch.int16)[~nan])
    assert int(got[0].view(torch.int16)[0, 3, 0, 0]) == 0x3F80  # 1 + 2^-8 ties down to even
    assert int(got[0].view(torch.int16)[0, 3, 0, 1]) == 0x3F82  # 1 + 3 * 2^-8 ties up to even


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_on_a_bfloat16_cache_computes_what_float32_holding_the_same_values_does(ops, head_dim, group):
    # The pools' values are bfloat16's (exact in float32 too), so the two caches hold the same numbers:
    # only the widening differs. The factory's NaN poison stays NaN in bfloat16, so a read past a
    # context still shows.
    lens = [1, 16, 17, 53, 200]
    batch = make_paged_batch(lens, block_size=16, kv_heads=KV_HEADS, head_dim=head_dim, dtype=torch.float32)
    key16, value16 = batch.key_cache.bfloat16(), batch.value_cache.bfloat16()
    query = make_queries(len(lens), KV_HEADS * group, head_dim, torch.float32)
    rest = (batch.block_tables, batch.context_lens, head_dim**-0.5)
    out = torch.full_like(query, float("nan"))
    got = ops.decode(query, key16, value16, *rest, out=out)
    assert got is out and got.dtype is torch.float32
    want = ops.decode(query, key16.float(), value16.float(), *rest)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        got, paged_decode_attention_torch(query, key16.float(), value16.float(), *rest)
    )
    wide = cpu_paged.CpuPagedOps(ops.library, ops.path, num_threads=4).decode(query, key16, value16, *rest)
    assert torch.equal(wide, got)  # split over threads: each sequence's sums are the same


def test_prefill_on_a_bfloat16_cache_widens_the_cached_prefix(ops):
    lens, query_lens = [5, 40, 33], [5, 7, 33]  # full prompt, extend after a prefix, full
    batch = make_paged_batch(lens, block_size=16, kv_heads=KV_HEADS, head_dim=32, dtype=torch.float32)
    key16, value16 = batch.key_cache.bfloat16(), batch.value_cache.bfloat16()
    query = make_queries(sum(query_lens), KV_HEADS * 2, 32, torch.float32)
    starts = query_start_loc(query_lens)
    rest = (batch.block_tables, starts, batch.context_lens, 0.2)
    got = ops.prefill(query, key16, value16, *rest)
    assert got.dtype is torch.float32
    want = paged_prefill_attention_torch(query, key16.float(), value16.float(), *rest)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_c_cache_operations_take_float32_rows_and_refuse_others_naming_them(ops):
    cache = torch.zeros(4, 4, KV_HEADS, 8, dtype=torch.bfloat16)
    rows = torch.ones(1, KV_HEADS, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"key dtype torch.bfloat16 != dtype torch.float32"):
        ops.write(rows, rows, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"query dtype torch.bfloat16 != dtype torch.float32"):
        ops.decode(
            rows, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0
        )
    half = cache.half()
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16 CPU cache, got torch.float16"):
        ops.write(rows.float(), rows.float(), half, half.clone(), torch.tensor([0]))


def test_arguments_the_c_code_cannot_read_are_refused_with_a_reason(ops):
    cache = torch.zeros(4, 4, KV_HEADS, 8)
    with pytest.raises(ValueError, match="past the cache's end"):
        ops.write(
            torch.ones(1, KV_HEADS, 8), torch.ones(1, KV_HEADS, 8), cache, cache.clone(), torch.tensor([16])
        )
    strided = torch.zeros(4, 4, 2 * KV_HEADS, 8)[:, :, :KV_HEADS]
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16 CPU cache"):
        ops.decode(
            torch.ones(1, KV_HEADS, 8),
            strided,
            strided,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        )


def test_loading_the_kernels_leaves_denormal_floats_alone(ops):
    # A library linked with -ffast-math turns on flush-to-zero process-wide: 1e-45 would read as 0
    # (a temperature of 1e-45 then divided logits by zero and failed the batch).
    tiny = torch.tensor([1e-45])
    assert tiny.item() > 0 and (tiny * 1).item() > 0


def test_load_says_why_the_kernels_cannot_run(monkeypatch, tmp_path):
    assert not isinstance(cpu_paged.load(torch.bfloat16, torch.device("cpu")), str)
    assert cpu_paged.load(torch.float16, torch.device("cpu")) == (
        "the C kernels take a float32 or bfloat16 cache, not float16"
    )
    assert "CPU tensors" in str(cpu_paged.load(torch.float32, torch.device("meta")))
    monkeypatch.setenv("KVPACT_CACHE_DIR", str(tmp_path))  # nothing built yet here
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    reason = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert isinstance(reason, str) and "could not build cpu_paged.c" in reason
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind


@pytest.mark.parametrize("in_features", [576, 37])  # a size with a constant trip count, and an odd one
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_torch_on_small_batches_and_leaves_larger_ones_to_torch(ops, in_features, with_bias):
    gen = torch.Generator().manual_seed(7)
    # 1302 x 576 floats: split over threads; 1302 features leave some past the last block of 4 features
    # in one thread's share and in each of four (325 or 326), and the rows below leave 0-3 past the last
    # block of 4 rows
    weight = torch.randn(1302, in_features, generator=gen)
    bias = torch.randn(1302, generator=gen) if with_bias else None
    for rows in (0, 1, 3, 4, 5, 7, 14, cpu_paged.SMALL_BATCH_ROWS, cpu_paged.SMALL_BATCH_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen)
        want = torch.nn.functional.linear(x, weight, bias)
        for threads in (1, 4):
            got = cpu_paged.CpuPagedOps(ops.library, ops.path, num_threads=threads).linear(x, weight, bias)
            assert got.shape == (rows, 1302)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # x a strided view (every other row): read as its rows, not as its storage
    x = torch.randn(6, in_features, generator=gen)[::2]
    want = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(ops.linear(x, weight, bias), want, atol=1e-4, rtol=1e-5)


def test_linear_refuses_what_torch_refuses():
    # mismatched sizes reach F.linear, whose error names the shapes
    loaded = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(loaded, str)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        loaded.linear(torch.ones(1, 5), torch.ones(3, 4))
    with pytest.raises(RuntimeError, match="size"):  # a bias of the wrong length is never read past its end
        loaded.linear(torch.ones(1, 4), torch.ones(3, 4), torch.ones(2))


def test_linear_runs_in_c_up_to_the_small_batch_size_and_on_torch_past_it(ops):
    weight = torch.randn(64, 32)

    def ran(rows: int) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ops.linear(torch.randn(rows, 32), weight)
        return {e.key for e in prof.key_averages()}

    assert "kvpact::cpu_linear" in ran(cpu_paged.SMALL_BATCH_ROWS)
    past = ran(cpu_paged.SMALL_BATCH_ROWS + 1)
    assert "kvpact::cpu_linear" not in past and "aten::linear" in past


def packing(ops: cpu_paged.CpuPagedOps) -> cpu_paged.CpuPagedOps:
    if not ops.panel_width:
        pytest.skip("this build packs no weights (kvp_panel_width 0: the CPU has neither AVX-512 nor AVX2)")
    return ops


@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_torch_at_every_batch_size_split_or_not(ops, with_bias):
    ops = packing(ops)
    gen = torch.Generator().manual_seed(5)
    # 1536 features = 48 panels; 37 inputs, an odd count; rows around the tiles of 8, the small batch's
    # limit, and a prefill chunk split over rows as well as panels (on 4 threads)
    for out_features, in_features in ((1536, 576), (64, 37)):
        weight = torch.randn(out_features, in_features, generator=gen)
        bias = torch.randn(out_features, generator=gen) if with_bias else None
        packed = ops.pack(weight)
        assert packed.shape == (out_features // ops.panel_width, in_features, ops.panel_width)
        for rows in (0, 1, 7, 8, 9, 63, cpu_paged.SMALL_BATCH_ROWS + 1, 700):
            x = torch.randn(rows, in_features, generator=gen)
            want = torch.nn.functional.linear(x, weight, bias)
            for threads in (1, 4):
                got = replace(ops, num_threads=threads).packed_linear(x, packed, bias)
                assert got.shape == (rows, out_features)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    # leading dimensions kept, a strided x read as its rows
    x = torch.randn(2, 6, 576, generator=gen)[:, ::2]
    torch.testing.assert_close(
        ops.packed_linear(x, ops.pack(torch.ones(32, 576)), None),
        x @ torch.ones(576, 32),
        atol=1e-4,
        rtol=1e-5,
    )


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of bfloat16 tensors, exact (in float64), rounded once to bfloat16."""
    b = None if bias is None else bias.double()
    return torch.nn.functional.linear(x.double(), weight.double(), b).to(torch.bfloat16)


def _assert_bf16_linear(
    ops: cpu_paged.CpuPagedOps, rows: tuple[int, ...], in_features: int, seed: int
) -> None:
    """packed_linear on bfloat16 weights gives the exact product rounded to bfloat16 (float32 sums:
    within a rounding of it), for each row count, on 1 and 4 threads, with and without a bias."""
    gen = torch.Generator().manual_seed(seed)
    out_features = 3 * ops.panel_width
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    packed = ops.pack(weight)
    for bias in (None, torch.randn(out_features, generator=gen).bfloat16()):
        for n in rows:
            x = torch.randn(n, in_features, generator=gen).bfloat16()
            want = _bf16_linear(x, weight, bias)
            for threads in (1, 4):
                got = replace(ops, num_threads=threads).packed_linear(x, packed, bias)
                assert got.dtype is torch.bfloat16 and got.shape == (n, out_features)
                torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_packed_linear_on_bfloat16_weights_reads_them_in_pairs_and_rounds_float32_sums_once(ops):
    ops = packing(ops)
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(2 * ops.panel_width, 38, generator=gen).bfloat16()
    packed = ops.pack(weight)
    # [out / panel, in / 2, panel, 2]: output feature j's weights for inputs 2i and 2i + 1 side by side
    assert packed.dtype is torch.bfloat16 and packed.shape == (2, 19, ops.panel_width, 2)
    p, i, j, h = 1, 7, 5, 1
    assert packed[p, i, j, h] == weight[p * ops.panel_width + j, 2 * i + h]
    # rows around the tiles, the small batch's limit and a prefill chunk split over rows too; 576
    # inputs as the model's, 38 a short panel
    rows = (0, 1, 2, 3, 6, 7, 8, 9, 14, 63, cpu_paged.SMALL_BATCH_ROWS + 1, 700)
    _assert_bf16_linear(ops, rows, 576, seed=7)
    _assert_bf16_linear(ops, (1, 5, 8), 38, seed=8)
    # leading dimensions kept
    x = torch.randn(2, 3, 38, generator=gen).bfloat16()
    torch.testing.assert_close(
        ops.packed_linear(x, packed).float(), _bf16_linear(x, weight, None).float(), rtol=2**-7, atol=1e-3
    )


@pytest.mark.parametrize("without", ["-mno-avx512bf16", "-mno-avx512f"])
def test_builds_without_bf16_dot_products_compute_the_same_bfloat16_linear(monkeypatch, tmp_path, without):
    # This machine's build may run vdpbf16ps (AVX512-BF16); a CPU without it widens the pairs by a shift
    # and a mask (AVX-512, panels of 32; AVX2, panels of 16): built here as such a CPU would get it
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if platform.machine() not in ("x86_64", "AMD64") or " avx2" not in cpuinfo or " fma" not in cpuinfo:
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    if without == "-mno-avx512bf16" and " avx512f" not in cpuinfo:
        pytest.skip("no AVX-512 here: the AVX2 case covers this CPU")
    monkeypatch.setattr(cpu_paged, "CFLAGS", (*cpu_paged.CFLAGS, without))
    monkeypatch.setenv("KVPACT_CACHE_DIR", str(tmp_path))
    ops = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(ops, str), ops
    assert ops.panel_width == (16 if without == "-mno-avx512f" else 32)
    _assert_bf16_linear(ops, (1, 5, 6, 7, 13, 300), 576, seed=9)


def test_pack_and_packed_linear_refuse_what_they_cannot_read(ops):
    ops = packing(ops)
    odd = ops.panel_width + 8
    with pytest.raises(ValueError, match=rf"shape \({odd}, 16\).*a multiple of {ops.panel_width}"):
        ops.pack(torch.ones(odd, 16))
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU"):
        ops.pack(torch.ones(64, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"shape \(64, 15\).*in even for bfloat16"):
        ops.pack(torch.ones(64, 15, dtype=torch.bfloat16))
    halves = ops.pack(torch.ones(64, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be bfloat16 .* \(the weight's dtype\)"):
        ops.packed_linear(torch.ones(3, 16), halves)
    with pytest.raises(ValueError, match=r"bias must be a contiguous bfloat16 CPU \[64\]"):
        ops.packed_linear(torch.ones(3, 16, dtype=torch.bfloat16), halves, torch.ones(64))
    packed = ops.pack(torch.ones(64, 16))
    with pytest.raises(ValueError, match="16 features"):
        ops.packed_linear(torch.ones(3, 17), packed)
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 CPU \[64\]"):
        ops.packed_linear(torch.ones(3, 16), packed, torch.ones(63))
    with pytest.raises(ValueError, match="the weight must be `pack`'s"):  # an [out, in] weight, not packed
        ops.packed_linear(torch.ones(3, 16), torch.ones(64, 16))
    with pytest.raises(ValueError, match="packs no weights"):  # a build without panels
        replace(ops, panel_width=0).pack(torch.ones(64, 16))


def test_an_avx2_build_packs_panels_of_16_and_computes_what_torch_does(monkeypatch, tmp_path):
    # This machine's own build may be AVX-512 (panels of 32); the AVX2 tile (6 rows x 16 features) is
    # built here the way an AVX2-only CPU would get it, -march=native less AVX-512
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if platform.machine() not in ("x86_64", "AMD64") or " avx2" not in cpuinfo or " fma" not in cpuinfo:
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    monkeypatch.setattr(cpu_paged, "CFLAGS", (*cpu_paged.CFLAGS, "-mno-avx512f"))
    monkeypatch.setenv("KVPACT_CACHE_DIR", str(tmp_path))
    ops = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(ops, str), ops
    assert ops.panel_width == 16
    gen = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(96, 37, generator=gen), torch.randn(96, generator=gen)
    packed = ops.pack(weight)
    assert packed.shape == (6, 37, 16)
    for rows in (0, 1, 5, 6, 7, 13, cpu_paged.SMALL_BATCH_ROWS + 1, 300):
        x = torch.randn(rows, 37, generator=gen)
        for threads in (1, 4):
            got = replace(ops, num_threads=threads).packed_linear(x, packed, bias)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    # and Q4_1 panels of 16 (tiles of 2 rows)
    weight = q4_1_weight(96, 64, seed=5)
    packed = ops.pack_q4(weight)
    assert packed is not None and packed.shape == (6, 2, ops.q4_block_bytes) and ops.quant_max_rows == 2
    for rows in (1, 2, 3, 7):
        x = torch.randn(rows, 64, generator=gen)
        got = ops.packed_linear_q4(x, packed, bias)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    weight = gguf_weight(96, 64, seed=6, qtype="Q8_0")  # and Q8_0 panels of 16
    packed = ops.pack_q8(weight)
    assert packed is not None and packed.shape == (6, 2, ops.q8_block_bytes)
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(
        ops.packed_linear_q8(x, packed, bias), torch.nn.functional.linear(x, weight, bias)
    )


def _split_linear_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, weight and F.linear's result, large enough that the C linear splits it over two threads."""
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(8, 576, generator=gen), torch.randn(640, 576, generator=gen)
    return x, weight, torch.nn.functional.linear(x, weight)


def test_linear_called_from_two_threads_at_once_gives_each_caller_its_own_result(ops):
    # The kernels' thread pool serves one caller at a time; a second at the same moment (another engine's
    # step thread in this process) runs on its own thread. Neither may wait forever or get the
    # other's result.
    two = cpu_paged.CpuPagedOps(ops.library, ops.path, num_threads=2)
    cases = [_split_linear_case(seed) for seed in (11, 12)]
    wrong: list[int] = []

    def run(i: int) -> None:
        x, weight, want = cases[i]
        for _ in range(300):
            if not torch.allclose(two.linear(x, weight), want, atol=1e-4, rtol=1e-5):
                wrong.append(i)

    callers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=60)
    assert not any(caller.is_alive() for caller in callers), "a caller still waits after 60 s"
    assert wrong == []


def test_a_forked_child_runs_split_kernels_on_threads_of_its_own(ops):
    # A process forked once the pool's threads run (a fork-started subprocess) has none of them: its
    # first split call must start its own, not wait forever for its parent's.
    two = cpu_paged.CpuPagedOps(ops.library, ops.path, num_threads=2)
    x, weight, want = _split_linear_case(13)
    torch.testing.assert_close(two.linear(x, weight), want, atol=1e-4, rtol=1e-5)  # the pool runs
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only for the right result
        os._exit(0 if torch.allclose(two.linear(x, weight), want, atol=1e-4, rtol=1e-5) else 1)
    deadline = time.monotonic() + 60
    while (reaped := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's split linear did not return within 60 s")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(reaped[1]) == 0


@pytest.mark.parametrize("rows", [0, 1, 3, 600])
def test_rms_norm_equals_torch(ops, rows):
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(rows, 576, generator=gen) * 4, torch.randn(576, generator=gen)
    want = torch.rms_norm(x, weight.shape, weight, 1e-5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = ops.rms_norm(x, weight, 1e-5)
    assert "kvpact::cpu_rms_norm" in {e.key for e in prof.key_averages()}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a strided x goes to torch's, with the same result
    strided = torch.randn(2 * rows, 576, generator=gen)[::2]
    want = torch.rms_norm(strided, weight.shape, weight, 1e-5)
    torch.testing.assert_close(ops.rms_norm(strided, weight, 1e-5), want)


def test_decode_layers_refuse_step_tensors_the_c_code_would_misread(ops):
    """Checked before any layer runs (so no layers are needed here): a token id outside the embedding, a
    slot past the pools' end, a context of 0 tokens, and a slot mapping of the wrong dtype, each named."""
    shape = cpu_paged.DecoderShape(
        hidden=8, q_heads=2, kv_heads=1, head_dim=4, intermediate=16, eps=1e-5, scale=0.5
    )
    no_layers = (cpu_paged.DecoderLayer * 0)()
    ends = cpu_paged.ModelEnds(torch.randn(10, 8), 10, torch.ones(2), torch.ones(8))
    table, one = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)

    def call(slots: torch.Tensor, context_lens: torch.Tensor, token: int = 9) -> torch.Tensor:
        ids, positions = torch.tensor([token]), torch.tensor([0])
        return ops.decode_layers(ids, positions, ends, no_layers, shape, slots, table, context_lens, 16, 64)

    with pytest.raises(ValueError, match=r"a token id is outside the vocabulary \[0, 10\)"):
        call(torch.tensor([3]), one, token=10)
    with pytest.raises(ValueError, match=r"a slot past the cache's end \(64 slots\)"):
        call(torch.tensor([64]), one)
    with pytest.raises(ValueError, match="context_lens must be >= 1"):
        call(torch.tensor([3]), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous torch.int64"):
        call(torch.tensor([3], dtype=torch.int32), one)
    # the last slot and token, no layers: the embedding row, normed by the final norm
    row = ends.embed[9]
    want = row / torch.sqrt(row.pow(2).mean() + 1e-5)
    torch.testing.assert_close(call(torch.tensor([63]), one)[0], want)


def gguf_weight(out_features: int, in_features: int, seed: int, qtype: str = "Q4_1") -> torch.Tensor:
    """A random weight as a GGUF holds it (Q4_1: the bundled file's projections; Q8_0: its embedding and
    tied head): quantized by the gguf package and dequantized back, what the loader gives the model."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    data = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)).numpy()
    dequantized = gguf.quants.dequantize(gguf.quants.quantize(data * 0.05, kind), kind)
    return torch.from_numpy(dequantized.reshape(out_features, in_features).copy())


def q4_1_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return gguf_weight(out_features, in_features, seed)


def test_q4_1_blocks_give_back_every_weight_a_q4_1_file_held_and_nothing_else(ops):
    weight = q4_1_weight(64, 96, seed=1)
    q, d, m = ops.q4_1_blocks(weight)
    assert q.dtype is torch.uint8 and int(q.max()) <= 15 and d.shape == m.shape == (64, 3)
    assert torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m)  # the file's float16s
    assert torch.equal(d.repeat_interleave(32, dim=1) * q.float() + m.repeat_interleave(32, dim=1), weight)
    nudged = weight.clone()
    nudged[5, 40] = torch.nextafter(nudged[5, 40], torch.tensor(1.0))  # one weight one ulp off
    assert ops.q4_1_blocks(nudged) is None
    assert ops.q4_1_blocks(torch.randn(64, 96)) is None  # float32 weights of no Q4_1 file
    assert ops.q4_1_blocks(weight[:, :90]) is None  # no whole blocks


def test_the_block_search_takes_a_float16_up_to_two_steps_from_the_quantizers_estimate(ops):
    # Blocks of known Q4_1 values (d and m float16s, levels 0..15 with both ends present); the estimate
    # handed to the search is d itself for some blocks and 1 or 2 float16 steps off it for others: every
    # block is found with its own d and levels; 3 steps off is past the search, so nothing is.
    gen = torch.Generator().manual_seed(0)
    out_features, num_blocks = 8, 12
    d = (torch.rand(out_features, num_blocks, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(out_features, num_blocks, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (out_features, num_blocks, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    blocks = d[..., None] * q.float() + m[..., None]
    steps = torch.tensor([0, -1, 1, -2, 2, 0]).repeat(out_features * num_blocks // 6)
    steps = steps.view(out_features, num_blocks).short()
    estimate = (d.half().view(torch.int16) + steps).view(torch.float16)
    found = ops.exact_blocks(blocks, m, estimate.float(), 0, 15)
    assert found is not None
    assert torch.equal(found[0].long(), q) and torch.equal(found[1], d)
    too_far = (d.half().view(torch.int16) + 3).view(torch.float16).float()
    assert ops.exact_blocks(blocks, m, too_far, 0, 15) is None


def test_the_block_search_rounds_its_scale_to_the_nearest_float16_as_torch_does(ops):
    # Blocks of zeros fit every candidate (level 0), so each block's d is the float16 nearest its scale:
    # every positive float16, every midpoint between two (ties to even) and the floats either side of
    # it, values past the largest, and 0.
    values = torch.arange(0, 0x7C00, dtype=torch.int32).short().view(torch.float16).float()
    midpoints = ((values[:-1].double() + values[1:].double()) / 2).float()
    beside = [torch.nextafter(midpoints, torch.tensor(side)) for side in (0.0, float("inf"))]
    scale = torch.cat((values, midpoints, *beside, torch.tensor([65519.0, 65520.0, 1e6])))
    zeros = torch.zeros(len(scale), 1)
    found = ops.exact_blocks(torch.zeros(len(scale), 1, 32), zeros, scale[:, None], 0, 15)
    assert found is not None
    assert torch.equal(found[1][:, 0], scale.half().float().clamp(max=65504))


def test_the_block_search_says_what_it_cannot_take(ops):
    blocks, base = torch.zeros(4, 2, 32), torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"blocks must be \[out, blocks, 32\].*got \(4, 2, 16\)"):
        ops.exact_blocks(torch.zeros(4, 2, 16), base, base, 0, 15)
    with pytest.raises(ValueError, match=r"got \(4, 2, 32\), \(4, 3\) and \(4, 2\)"):
        ops.exact_blocks(blocks, torch.zeros(4, 3), base, 0, 15)
    with pytest.raises(ValueError, match="must be float32 CPU tensors"):
        ops.exact_blocks(blocks, base.double(), base, 0, 15)
    with pytest.raises(ValueError, match=r"levels 0..255 do not fit an int8"):
        ops.exact_blocks(blocks, base, base, 0, 255)
    weight = q4_1_weight(64, 96, seed=1)
    weight[3, 7] = float("nan")  # no GGUF block holds one: never these blocks
    assert ops.q4_1_blocks(weight) is None and ops.q8_0_blocks(weight) is None


@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_q4_computes_what_float32_does_on_the_same_weights_and_each_row_alike_in_any_batch(
    ops, with_bias
):
    ops = packing(ops)
    weight = q4_1_weight(1536, 576, seed=2)
    bias = torch.randn(1536) if with_bias else None
    packed = ops.pack_q4(weight)
    assert packed is not None and packed.dtype is torch.uint8
    assert packed.shape == (1536 // ops.panel_width, 576 // cpu_paged.QUANT_BLOCK, ops.q4_block_bytes)
    assert packed.numel() * 5 < weight.numel() * 4  # 6 bits a weight
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(13, 576, generator=gen)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    scale = x.abs().double() @ weight.abs().double().T + (0 if bias is None else bias.abs().double())
    alone = [ops.packed_linear_q4(x[i : i + 1], packed, bias)[0] for i in range(13)]
    for rows in (1, 2, 5, 6, 7, 13):
        for threads in (1, 4):
            got = replace(ops, num_threads=threads).packed_linear_q4(x[:rows], packed, bias)
            assert ((got.double() - want[:rows]).abs() <= 1e-6 * scale[:rows]).all()  # float32 rounding
            for i in range(rows):  # the sums' order is a row's own: the same bits alone or in any batch
                assert torch.equal(got[i], alone[i]), (rows, threads, i)
    assert ops.pack_q4(torch.randn(1536, 576)) is None  # not Q4_1: the float32 panels stay the only ones
    assert ops.pack_q4(q4_1_weight(48, 576, seed=4)) is None  # not whole panels


def test_q8_0_blocks_and_panels_give_back_a_q8_0_weight_and_compute_what_float32_does(ops):
    ops = packing(ops)
    weight = gguf_weight(1536, 576, seed=6, qtype="Q8_0")
    q, d = ops.q8_0_blocks(weight)
    assert q.dtype is torch.int8 and torch.equal(d.half().float(), d)
    assert torch.equal(d.repeat_interleave(32, dim=1) * q.float(), weight)
    assert ops.q8_0_blocks(q4_1_weight(64, 96, seed=1)) is None  # Q4_1's offsets are not Q8_0
    assert ops.pack_q8(torch.randn(1536, 576)) is None
    packed = ops.pack_q8(weight)
    assert packed.shape == (1536 // ops.panel_width, 576 // cpu_paged.QUANT_BLOCK, ops.q8_block_bytes)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(7))
    want = torch.nn.functional.linear(x.double(), weight.double())
    scale = x.abs().double() @ weight.abs().double().T
    alone = [ops.packed_linear_q8(x[i : i + 1], packed)[0] for i in range(7)]
    for rows in (1, 6, 7):
        got = ops.packed_linear_q8(x[:rows], packed)
        assert ((got.double() - want[:rows]).abs() <= 1e-6 * scale[:rows]).all()
        assert all(torch.equal(got[i], alone[i]) for i in range(rows))
    with pytest.raises(
        ValueError, match=r"packed_linear_q8: the weight must be `pack_q8`'s, got torch.uint8"
    ):
        ops.packed_linear_q8(x, ops.pack_q4(q4_1_weight(1536, 576, seed=2)))  # another layout's bytes
    # the head's matmul: Q8_0 for a step's few sampled rows, the float32 panels past them
    matmul = ops.small_rows_linear(packed)
    few, many = x[: ops.quant_max_rows], torch.randn(ops.quant_max_rows + 1, 576)
    assert torch.equal(matmul(few, ops.pack(weight), None), ops.packed_linear_q8(few, packed))
    assert torch.equal(matmul(many, ops.pack(weight), None), ops.packed_linear(many, ops.pack(weight)))
