"""benchmarks/reused_pool.py times decode steps on a paged pool that must reuse freed blocks."""

from __future__ import annotations

import re

from benchmarks import reused_pool
from tests.factories.tiny_models import make_tiny_llama


def test_each_round_times_both_caches_decode_steps_and_the_median_ratio_is_printed(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    assert reused_pool.main(["--model", str(model), "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    pool = re.search(r"paged pool: (\d+) blocks of 16; 4 requests", out)
    rounds = re.findall(
        r"round \d: decode step of 4 sequences, median: paged ([\d.]+) ms, eager ([\d.]+) ms", out
    )
    assert pool and int(pool.group(1)) > 0
    assert len(rounds) == 2 and all(float(p) > 0 and float(e) > 0 for p, e in rounds)
    assert re.search(r"eager / paged, median of 2 rounds: [\d.]+", out)
