"""benchmarks/served_rounds.py: served (router + worker) against in-process, round by round, at the
--max-num-seqs and request count asked for."""

from __future__ import annotations

import re

from benchmarks import served_rounds
from tests.factories.tiny_models import make_tiny_llama


def test_one_sequence_at_a_time_each_round_times_both_sides_and_the_median_is_printed(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    argv = ["--model", str(model), "--rounds", "2", "--max-num-seqs", "1", "--requests", "3"]
    assert served_rounds.main(argv) == 0
    out = capsys.readouterr().out
    rounds = re.findall(
        r"round \d: served ([\d.]+) s, in-process ([\d.]+) s, served / in-process tok/s [\d.]+", out
    )
    assert len(rounds) == 2 and all(float(s) > 0 and float(i) > 0 for s, i in rounds)
    assert re.search(
        r"served / in-process, median of 2 rounds: [\d.]+ \(--max-num-seqs 1, 3 requests, \d+ tokens\)", out
    )
    # where the CPU went, each round: the client, the router, the worker (its id), the in-process engine
    cpu = re.findall(r"  (\S+): ([\d.]+) CPU-s, ([\d.]+) ms a token \(busiest threads: [\d., ]*\)", out)
    assert [name for name, _, _ in cpu] == ["client", "router", "paged", "in-process"] * 2, out
    assert all(float(seconds) > 0 for name, seconds, _ in cpu if name != "router"), cpu
