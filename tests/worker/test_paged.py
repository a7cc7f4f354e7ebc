"""The paged path: the AttentionStep against a plain reference, prefix caching and preemption end to end."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpact import kernels
from kvpact.shared.features import FeatureIntents, FeatureMode
from kvpact.shared.intent import PagedBackend
from kvpact.worker.engine.request import SamplingParams
from kvpact.worker.engine.sequence import ScheduledChunk, Sequence
from kvpact.worker.kv.paged import PagedCache, paged_ops, reference_ops
from kvpact.worker.scheduler.block_manager import BlockTable
from tests.factories.tiny_models import ContiguousAttention
from tests.worker.conftest import greedy, run_staggered

HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 4

NO_PREFIX = FeatureIntents(prefix_caching=FeatureMode.OFF)


def fake_seq(name: str, num_tokens: int, block_ids: list[int]) -> Sequence:
    s = Sequence.create(
        0, name, list(range(num_tokens)), SamplingParams(), 1, frozenset(), torch.device("cpu")
    )
    s.block_table = BlockTable(block_ids=block_ids)
    return s


@pytest.mark.parametrize(
    ("cache_dtype", "rows"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["float32", "bfloat16-cache", "bfloat16-model"],
)
@torch.inference_mode()
def test_paged_step_equals_contiguous_attention_for_mixed_decode_prefill_and_extend_chunks(cache_dtype, rows):
    # On the C kernels whatever the cache holds: float32 rows in and out (a bfloat16 model's cast up and
    # back). Inputs bfloat16 holds exactly, so a bfloat16 cache holds them as they are and only a
    # bfloat16 model's output is rounded.
    cache = PagedCache(1, 32, BS, KV_HEADS, DIM, cache_dtype, torch.device("cpu"), PagedBackend.TORCH)
    assert cache.cpu_kernels and cache.rows_dtype is torch.float32
    ref = ContiguousAttention()
    torch.manual_seed(0)
    # blocks deliberately scattered and out of order
    a, b, c = (
        fake_seq("a", 40, [7, 3, 30, 12, 1, 9, 20, 21, 22, 23]),
        fake_seq("b", 40, [5, 0, 2, 31, 4, 6]),
        fake_seq("c", 40, [8, 10, 11, 13]),
    )
    steps = [
        [ScheduledChunk(a, 0, 9), ScheduledChunk(b, 0, 6)],  # two prefills
        [ScheduledChunk(a, 9, 1), ScheduledChunk(b, 6, 1), ScheduledChunk(c, 0, 3)],  # 2 decodes + prefill
        [ScheduledChunk(a, 10, 1), ScheduledChunk(c, 3, 7), ScheduledChunk(b, 7, 5)],  # decode + 2 extends
    ]
    ids = {"a": 0, "b": 1, "c": 2}
    for chunks in steps:
        num_decodes = sum(1 for ch in chunks if ch.num_tokens == 1)
        assert all(ch.num_tokens == 1 for ch in chunks[:num_decodes])
        n = sum(ch.num_tokens for ch in chunks)
        q, k, v = (torch.randn(n, h, DIM).bfloat16().float() for h in (HEADS, KV_HEADS, KV_HEADS))
        got = cache.attention_step(chunks, num_decodes).forward(0, q.to(rows), k.to(rows), v.to(rows))
        want = ref.step([ids[ch.seq.request_id] for ch in chunks], [ch.num_tokens for ch in chunks]).forward(
            0, q, k, v
        )
        assert got.dtype is rows
        tolerance = 1e-5 if rows is torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


RESIDENT_PROBE = """
import os
import torch
from kvpact.shared.intent import PagedBackend
from kvpact.worker.kv.paged import PagedCache
from tests.factories.processes import rss_bytes

before = rss_bytes(os.getpid())
cache = PagedCache(2, 2048, 16, 4, 64, torch.float32, torch.device("cpu"), PagedBackend.TORCH)
print(cache.memory_bytes, rss_bytes(os.getpid()) - before)
"""
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_the_pool_is_resident_when_the_cache_is_built_not_during_the_first_requests():
    """A fresh pool's pages fault in at the first writes, in the first requests' steps (docs/performance.md
    "A cold KV pool"); built, the pool is already in memory. In a fresh process: a
    long-lived one may hand the cache memory that an earlier test already touched."""
    probe = [sys.executable, "-c", RESIDENT_PROBE]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    pool, grown = map(int, done.stdout.split())
    assert pool == 128 * 2**20
    assert grown >= 0.9 * pool, f"RSS grew {grown / 2**20:.1f} MiB for a 128 MiB pool"


def test_step_metadata_is_what_the_kernels_check_and_each_group_is_only_as_wide_as_it_needs():
    cache = PagedCache(1, 32, BS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), PagedBackend.TORCH)
    a, b, c = fake_seq("a", 40, [7, 3, 30]), fake_seq("b", 40, [5]), fake_seq("c", 40, [8, 10, 11, 13, 2])
    # a decodes its 10th token, b its 3rd; c extends 6 cached tokens by 11 (blocks for 17 tokens)
    chunks = [ScheduledChunk(a, 9, 1), ScheduledChunk(b, 2, 1), ScheduledChunk(c, 6, 11)]
    step = cache.attention_step(chunks, 2)
    assert step.slot_mapping.dtype is torch.int64
    assert step.slot_mapping.tolist() == [30 * BS + 1, 5 * BS + 2] + [  # BS 4: position 9 is block 2
        [8, 10, 11, 13, 2][p // BS] * BS + p % BS for p in range(6, 17)
    ]
    assert step.decode_tables.dtype is step.prefill_tables.dtype is torch.int32
    assert step.decode_tables.tolist() == [[7, 3, 30], [5, 0, 0]]  # zero-padded to the longest decode table
    assert step.prefill_tables.tolist() == [[8, 10, 11, 13, 2]]
    assert step.decode_context_lens.dtype is step.prefill_context_lens.dtype is torch.int32
    assert (step.decode_context_lens.tolist(), step.prefill_context_lens.tolist()) == ([10, 3], [17])
    assert step.prefill_start_loc.dtype is torch.int32 and step.prefill_start_loc.tolist() == [0, 11]
    assert step.max_prefill_len == 11
    for t in (step.slot_mapping, step.decode_tables, step.prefill_tables, step.prefill_start_loc):
        assert t.is_contiguous()


def test_every_token_goes_to_the_slot_its_position_names_for_any_chunk_boundaries():
    # slot(p) = table[p // block_size] * block_size + p % block_size, for chunks starting and ending
    # anywhere in a block, of one token or many, on scattered tables
    cache = PagedCache(1, 64, BS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), PagedBackend.TORCH)
    rng = random.Random(5)
    for _ in range(200):
        chunks = []
        for i in range(rng.randint(1, 5)):
            start, n = rng.randint(0, 30), rng.choice([1, 1, rng.randint(1, 25)])
            blocks = rng.sample(range(64), -(-(start + n) // BS) + rng.randint(0, 2))
            chunks.append(ScheduledChunk(fake_seq(f"s{i}", 60, blocks), start, n))
        chunks.sort(key=lambda c: c.num_tokens != 1)  # decodes first, as the scheduler orders them
        step = cache.attention_step(chunks, sum(c.num_tokens == 1 for c in chunks))
        want = [
            c.seq.block_table.block_ids[p // BS] * BS + p % BS for c in chunks for p in range(c.start, c.end)
        ]
        assert step.slot_mapping.tolist() == want


def test_split_counts_are_chosen_per_step_from_the_warmed_variants():
    # 4 stand-in SMs on the CPU, 2 KV heads: one decode wants 4 * 4 / 2 = 8 splits, if its context is long.
    cache = PagedCache(
        1, 64, BS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), PagedBackend.TORCH, max_model_len=256
    )
    assert cache.split_variants == (1, 2)  # 256 tokens = 8 tiles of 32: at most 2 splits of 4 tiles
    long_seq = fake_seq("a", 256, list(range(64)))
    step = cache.attention_step([ScheduledChunk(long_seq, 255, 1)], 1)
    assert step.decode_splits == 2
    short = cache.attention_step([ScheduledChunk(fake_seq("b", 9, [0, 1, 2]), 8, 1)], 1)
    assert short.decode_splits == 1
    # Without max_model_len the pool bounds it (1024 tokens); a wider table than max_model_len (never
    # scheduled) is capped at what the warm-up compiled.
    unbounded = PagedCache(1, 256, BS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), PagedBackend.TORCH)
    assert unbounded.split_variants == (1, 2, 4, 8) and cache.decode_splits(1, 64) == 2


def test_a_decode_only_step_builds_no_prefill_metadata():
    cache = PagedCache(1, 32, BS, KV_HEADS, DIM, torch.float32, torch.device("cpu"), PagedBackend.TORCH)
    step = cache.attention_step([ScheduledChunk(fake_seq("a", 40, [7, 3]), 5, 1)], 1)
    assert (step.has_prefills, step.max_prefill_len) == (False, 0) and step.decode_tables.tolist() == [[7, 3]]
    prefill_half = ("prefill_tables", "prefill_context_lens", "prefill_start_loc")
    assert not any(hasattr(step, name) for name in prefill_half)


def test_backend_choice_is_only_which_functions_run():
    # The torch backend's kernels take the Triton wrappers' signature (out=, check=) and agree with
    # the references; on a CPU float32 cache they are the C kernels, and the cache says so.
    torch_ops, which = paged_ops(PagedBackend.TORCH, torch.float32, torch.device("cpu"))
    assert which.startswith("CPU C kernels"), which
    torch.manual_seed(0)
    key_cache, value_cache = torch.randn(2, 8, BS, KV_HEADS, DIM).unbind(0)
    query, tables = torch.randn(2, HEADS, DIM), torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([3, 7], dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    got = torch_ops.decode(
        query, key_cache, value_cache, tables, lens, 0.25, 2, out=out, workspace=None, check=True
    )
    want = kernels.paged_decode_attention_torch(query, key_cache, value_cache, tables, lens, 0.25)
    assert got is out
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    ref_ops, which = paged_ops(PagedBackend.TORCH, torch.bfloat16, torch.device("cpu"), cpu_kernels=False)
    assert ref_ops == reference_ops() and "cpu-kernels realized off" in which, which
    # The plan decides: told to run the C kernels where they cannot, the build refuses instead of degrading.
    with pytest.raises(
        RuntimeError, match="the plan realized --cpu-kernels.*float32 or bfloat16 cache, not float16"
    ):
        paged_ops(PagedBackend.TORCH, torch.float16, torch.device("cpu"))
    triton_ops, _ = paged_ops(PagedBackend.TRITON)  # imports the Triton wrappers; nothing is launched
    assert (triton_ops.write, triton_ops.decode, triton_ops.prefill) == (
        kernels.reshape_and_cache,
        kernels.paged_decode_attention,
        kernels.paged_prefill_attention,
    )
    with pytest.raises(ValueError, match="concrete backend"):
        paged_ops(PagedBackend.AUTO)


def record_chunks(engine) -> dict[str, list[tuple[int, int]]]:
    seen: dict[str, list[tuple[int, int]]] = {}
    run = engine.step_loop.runner.run

    def spy(chunks):  # type: ignore[no-untyped-def]
        for ch in chunks:
            seen.setdefault(ch.seq.request_id, []).append((ch.start, ch.num_tokens))
        return run(chunks)

    engine.step_loop.runner.run = spy
    return seen


def test_prefix_cache_hit_computes_only_the_rest_and_gives_the_same_output(make_engine, tiny_llama):
    prefix = tuple(range(10, 58))  # 48 tokens = 3 blocks of 16
    first, second = prefix + (100, 101, 102, 103, 104), prefix + (200, 201, 202, 203, 204, 205, 206)
    engine = make_engine(tiny_llama, "on", max_model_len=128, context_tokens=1024)
    chunks = record_chunks(engine)
    [one] = engine.run([greedy("first", first, 20)])
    [two] = engine.run([greedy("second", second, 20)])
    assert one.usage.cached_prompt_tokens == 0
    assert two.usage.cached_prompt_tokens == 3 * 16
    assert chunks["second"][0] == (48, len(second) - 48)  # the prefill skipped the 3 cached blocks

    cold = make_engine(tiny_llama, "on", max_model_len=128, context_tokens=1024, features=NO_PREFIX)
    [reference] = cold.run([greedy("second", second, 20)])
    assert reference.usage.cached_prompt_tokens == 0
    assert two.token_ids == reference.token_ids and two.text == reference.text


def test_preemption_under_a_small_pool_keeps_every_output_exact(make_engine, tiny_llama):
    requests = [greedy(f"r{i}", tuple(range(3 + i, 23 + i)), 40) for i in range(6)]  # 20 + 40 tokens each
    roomy = make_engine(tiny_llama, "on", max_model_len=64, context_tokens=4096)
    expected = roomy.run(requests, timeout=120)
    assert roomy.stats().num_preemptions == 0

    # 64 tokens = 4 blocks: one max_model_len sequence fits, 6 x 60 tokens do not
    tight = make_engine(tiny_llama, "on", max_model_len=64, context_tokens=64)
    assert tight.realized.num_blocks == 4
    got = run_staggered(tight, requests, gap_s=0.002)
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.usage.completion_tokens for r in got] == [40] * 6
    assert stats.num_free_blocks == stats.num_total_blocks == 4
