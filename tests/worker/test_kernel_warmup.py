"""The startup warm-up compiles every kernel variant serving can reach (worker/startup/kernel_warmup.py).

The split heuristic (kernels/splits.py) is checked against a brute-force enumeration of the split
counts it picks; the warm-up itself runs under the Triton interpreter in a subprocess, where every
kernel launch is recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpact.kernels.splits import MAX_SPLITS, MIN_TILES_PER_SPLIT, TILE, default_num_splits, split_variants

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("num_sms", [4, 58, 108, 132])
@pytest.mark.parametrize(("block_size", "max_model_len"), [(8, 100), (16, 2048), (32, 4096), (64, 8192)])
def test_split_variants_are_every_count_the_heuristic_picks(kv_heads, num_sms, block_size, max_model_len):
    max_blocks = -(-max_model_len // block_size)
    picked = {
        default_num_splits(num_seqs, kv_heads, width * block_size, num_sms)
        for num_seqs in range(1, 257)
        for width in range(1, max_blocks + 1)
    }
    assert set(split_variants(kv_heads, max_blocks * block_size, num_sms)) == picked


def test_the_heuristic_aims_for_four_programs_per_sm_rounding_up():
    # H100 (132 SMs), 8 KV heads: batch 16 is 128 programs; 4 per SM wants 528, so 4.1 -> 8 splits.
    assert default_num_splits(16, 8, 2048, 132) == 8
    assert default_num_splits(1, 8, 8192, 132) == MAX_SPLITS  # 66 wanted, capped
    assert default_num_splits(256, 8, 8192, 132) == 1  # 2048 programs fill the device already
    assert default_num_splits(1, 8, 512, 132) == 4  # 16 tiles: splits of >= MIN_TILES_PER_SPLIT tiles
    for num_seqs in (1, 3, 16, 64):
        for context in (32, 1000, 2048, 30_000):
            got = default_num_splits(num_seqs, 8, context, 108)
            assert got & (got - 1) == 0 and got <= MAX_SPLITS
            assert got == 1 or -(-context // TILE) // got >= MIN_TILES_PER_SPLIT  # never a too-short split
            if got < MAX_SPLITS and -(-context // TILE) // (2 * got) < MIN_TILES_PER_SPLIT:
                continue  # bounded by the split length, not by the program count
            assert num_seqs * 8 * got >= 4 * 108 or got == MAX_SPLITS


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("block_size", "max_model_len", "max_num_seqs"), [(16, 1024, 8), (32, 200, 4)])
def test_warm_up_launches_every_variant_serving_can_pick(block_size, max_model_len, max_num_seqs):
    pytest.importorskip("triton")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.worker.warmup_case",
            str(block_size),
            str(max_model_len),
            str(max_num_seqs),
        ],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    splits = got["split_variants"]
    assert set(got["picked"]) <= set(splits)  # serving picks nothing the warm-up did not run
    assert set(got["picked"]) == set(splits)  # and the warm-up runs nothing serving cannot pick
    decode = {f"paged_decode_attention splits={s}" for s in splits}
    merge = {f"merge_splits splits={s}" for s in splits if s > 1}
    assert set(got["launches"]) == decode | merge | {"reshape_and_cache", "paged_prefill_attention"}
    assert got["compiled"] == got["compiles_after_ready"] == 0  # the interpreter compiles nothing
    if max_model_len == 1024:  # 4 stand-in SMs, 2 KV heads: 8 splits wanted, 32 tiles allow 8
        assert splits == [1, 2, 4, 8]
        assert got["variants"] == [
            "reshape_and_cache",
            "prefill",
            "decode splits=1",
            "decode splits=2 (+ merge)",
            "decode splits=4 (+ merge)",
            "decode splits=8 (+ merge)",
        ]
