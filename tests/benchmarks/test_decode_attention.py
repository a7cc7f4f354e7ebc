"""benchmarks/decode_attention.py times the C decode attention on a paged pool and on eager slots."""

from __future__ import annotations

import re

import pytest

from benchmarks import decode_attention


def test_prompts_take_consecutive_blocks_and_the_decoded_tails_come_after_every_prompt():
    tables = decode_attention.paged_tables([40, 20], tail=8, block_size=16, width=4)
    # prompts: 32 tokens -> blocks 0, 1; 12 tokens -> block 2; tails: 40 needs a third block, 20 a second
    assert tables.tolist() == [[0, 1, 3, 0], [2, 4, 0, 0]]
    descending = decode_attention.paged_tables([40, 20], 8, 16, 4, placement="descending")
    assert descending.tolist() == [[4, 3, 1, 0], [2, 0, 0, 0]]
    shuffled = decode_attention.paged_tables([40, 20], 8, 16, 4, placement="random")
    assert sorted(shuffled[0, :3].tolist() + shuffled[1, :2].tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prints_both_steps_and_their_ratio(capsys, dtype):
    args = ["--seqs", "3", "--contexts", "20-70", "--layers", "2", "--rounds", "2", "--max-model-len", "96"]
    assert decode_attention.main([*args, "--cache-dtype", dtype]) == 0
    out = capsys.readouterr().out
    assert f"3 sequences, contexts 20-70, 2 layers, 2 rounds, {dtype} caches:" in out
    figures = r"paged \(block 16, ascending\) ([\d.]+) ms, eager ([\d.]+) ms, eager / paged ([\d.]+)"
    found = re.search(figures, out)
    assert found and all(float(x) > 0 for x in found.groups())


def test_contexts_past_the_slot_are_refused():
    with pytest.raises(SystemExit) as exited:
        decode_attention.main(["--contexts", "10-200", "--max-model-len", "128"])
    assert exited.value.code == 2
