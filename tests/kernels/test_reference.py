"""The pure-torch references against textbook dense attention, and their argument checks."""

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpact.kernels.reference import (
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
    reshape_and_cache_torch,
)
from tests.kernels.factory import dense_attention, make_paged_batch, make_queries, query_start_loc

KV_HEADS = 2


def decode_case(head_dim: int, group: int, block_size: int, lens: list[int], dtype=torch.float32):
    batch = make_paged_batch(lens, block_size=block_size, kv_heads=KV_HEADS, head_dim=head_dim, dtype=dtype)
    query = make_queries(len(lens), KV_HEADS * group, head_dim, dtype)
    return batch, query


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_dense_attention(head_dim, group, block_size):
    lens = [1, block_size, block_size + 1, 3 * block_size + 5]
    batch, query = decode_case(head_dim, group, block_size, lens)
    scale = head_dim**-0.5
    out = paged_decode_attention_torch(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, scale
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    for i in range(len(lens)):
        expected = dense_attention(query[i : i + 1], batch.keys[i], batch.values[i], scale)[0]
        torch.testing.assert_close(out[i].double(), expected, atol=1e-5, rtol=1e-5)


# (cached prefix, new tokens) per sequence
PREFILL_BATCHES = {
    "one_prompt": [(0, 37)],
    "one_token": [(0, 1)],
    "prefix_hit": [(32, 5)],
    "ragged_mixed": [(0, 1), (0, 17), (32, 5), (31, 70), (16, 16)],
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", sorted(PREFILL_BATCHES))
def test_prefill_matches_dense_attention(head_dim, group, block_size, name):
    seqs = PREFILL_BATCHES[name]
    lens = [p + n for p, n in seqs]
    q_lens = [n for _, n in seqs]
    batch = make_paged_batch(
        lens, block_size=block_size, kv_heads=KV_HEADS, head_dim=head_dim, dtype=torch.float32
    )
    query = make_queries(sum(q_lens), KV_HEADS * group, head_dim, torch.float32)
    qsl = query_start_loc(q_lens)
    scale = head_dim**-0.5
    out = paged_prefill_attention_torch(
        query, batch.key_cache, batch.value_cache, batch.block_tables, qsl, batch.context_lens, scale
    )
    for i in range(len(seqs)):
        start, end = int(qsl[i]), int(qsl[i + 1])
        expected = dense_attention(query[start:end], batch.keys[i], batch.values[i], scale)
        torch.testing.assert_close(out[start:end].double(), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 8, 16]),
    group=st.sampled_from([1, 2, 3]),
)
def test_prefill_matches_dense_attention_on_random_batches(seqs, block_size, group):
    lens = [p + n for p, n in seqs]
    q_lens = [n for _, n in seqs]
    batch = make_paged_batch(lens, block_size=block_size, kv_heads=KV_HEADS, head_dim=16, dtype=torch.float32)
    query = make_queries(sum(q_lens), KV_HEADS * group, 16, torch.float32)
    qsl = query_start_loc(q_lens)
    out = paged_prefill_attention_torch(
        query, batch.key_cache, batch.value_cache, batch.block_tables, qsl, batch.context_lens, 0.25
    )
    for i in range(len(seqs)):
        start, end = int(qsl[i]), int(qsl[i + 1])
        expected = dense_attention(query[start:end], batch.keys[i], batch.values[i], 0.25)
        torch.testing.assert_close(out[start:end].double(), expected, atol=1e-5, rtol=1e-5)


def test_prefill_of_one_token_per_sequence_equals_decode():
    lens = [1, 16, 17, 53]
    batch, query = decode_case(64, 4, 16, lens)
    args = (batch.key_cache, batch.value_cache, batch.block_tables)
    decode = paged_decode_attention_torch(query, *args, batch.context_lens, 0.125)
    prefill = paged_prefill_attention_torch(query, *args, query_start_loc([1] * 4), batch.context_lens, 0.125)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("unused", [-1, 0, 2**31 - 1])
def test_unused_block_table_entries_are_never_used(unused):
    lens = [1, 16, 17, 53]
    batch, query = decode_case(64, 4, 16, lens)
    expected = paged_decode_attention_torch(
        query, batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, 0.125
    )
    tables = batch.block_tables.clone()
    tables[tables == batch.poison_block] = unused
    out = paged_decode_attention_torch(
        query, batch.key_cache, batch.value_cache, tables, batch.context_lens, 0.125
    )
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    prefill = paged_prefill_attention_torch(
        query, batch.key_cache, batch.value_cache, tables, query_start_loc([1] * 4), batch.context_lens, 0.125
    )
    torch.testing.assert_close(prefill, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_returns_query_dtype_close_to_fp32(dtype):
    lens = [1, 16, 17, 53]
    batch, query = decode_case(64, 4, 16, lens, dtype=dtype)
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.context_lens, 0.125)
    out = paged_decode_attention_torch(query, *args)
    assert out.dtype == dtype
    fp32 = paged_decode_attention_torch(
        query.float(), batch.key_cache.float(), batch.value_cache.float(), *args[2:]
    )
    torch.testing.assert_close(out.float(), fp32, atol=2e-2, rtol=2e-2)


def test_reshape_and_cache_writes_slots_and_skips_padding():
    batch = make_paged_batch([5, 20], block_size=16, kv_heads=2, head_dim=8, dtype=torch.float32)
    empty = torch.full_like(batch.key_cache, float("nan"))
    key_cache, value_cache = empty.clone(), empty.clone()
    pad = torch.tensor([-1])
    slots = torch.cat([batch.slot_mappings[0], pad, batch.slot_mappings[1], pad])
    garbage = torch.full((1, 2, 8), 7.0)
    key = torch.cat([batch.keys[0], garbage, batch.keys[1], garbage])
    value = torch.cat([batch.values[0], garbage, batch.values[1], garbage])
    reshape_and_cache_torch(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, batch.key_cache, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, batch.value_cache, atol=0, rtol=0, equal_nan=True)


def bad_decode_args(**overrides):
    batch, query = decode_case(64, 4, 16, [1, 17])
    args = dict(
        query=query,
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        block_tables=batch.block_tables,
        context_lens=batch.context_lens,
        scale=0.125,
    )
    args.update({k: v(args) for k, v in overrides.items()})
    return args


@pytest.mark.parametrize(
    "override, message",
    [
        ({"block_tables": lambda a: a["block_tables"].long()}, "block_tables must have dtype"),
        ({"context_lens": lambda a: a["context_lens"].long()}, "context_lens must have dtype"),
        (
            {"context_lens": lambda a: a["context_lens"].repeat_interleave(2)[::2]},
            "context_lens must be contiguous",
        ),
        ({"query": lambda a: a["query"][:, :7]}, "multiple of kv_heads"),
        ({"query": lambda a: a["query"][..., :32]}, "head_dim 32 != cache head_dim 64"),
        ({"query": lambda a: a["query"].half()}, "query dtype torch.float16 != cache dtype"),
        ({"query": lambda a: a["query"][:1]}, "query has 1 sequences but context_lens has 2"),
        ({"value_cache": lambda a: a["value_cache"][:-1]}, "value_cache shape"),
        ({"key_cache": lambda a: a["key_cache"][0]}, "key_cache must be 4-D"),
        (
            {"query": lambda a: a["query"].transpose(1, 2).contiguous().transpose(1, 2)},
            "contiguous in its last dim",
        ),
    ],
)
def test_decode_rejects_bad_arguments(override, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention_torch(**bad_decode_args(**override))


def test_prefill_rejects_wrong_query_start_loc_length():
    args = bad_decode_args()
    with pytest.raises(ValueError, match="needs num_seqs \\+ 1 = 3"):
        paged_prefill_attention_torch(
            args["query"],
            args["key_cache"],
            args["value_cache"],
            args["block_tables"],
            query_start_loc([1, 1])[:2],
            args["context_lens"],
            0.125,
        )


def test_cache_write_rejects_int32_slot_mapping():
    batch = make_paged_batch([5], block_size=16, kv_heads=2, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        reshape_and_cache_torch(
            batch.keys[0], batch.values[0], batch.key_cache, batch.value_cache, batch.slot_mappings[0].int()
        )


def test_kernels_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import kvpact.kernels, kvpact.kernels.reference\n"
        "from kvpact.kernels.support import triton_version\n"
        "assert triton_version() is None\n"
        "try:\n"
        "    from kvpact.kernels import paged_decode_attention\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
