"""benchmarks/served_ab.py: two sets of worker flags, each behind its own router, rounds alternated."""

from __future__ import annotations

import re

from benchmarks import served_ab
from tests.factories.tiny_models import make_tiny_llama


def test_one_stream_each_side_prints_its_wall_and_cpu_per_token_and_the_medians(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    argv = [
        "--model",
        str(model),
        "--a",
        "--event-loop asyncio",
        "--b",
        "",
        "--rounds",
        "2",
        "--tokens",
        "16",
    ]
    assert served_ab.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^a \(--event-loop asyncio\): ready in [\d.]+ s$", out, re.MULTILINE), out
    assert re.search(r"^b \(no flags\): ready in [\d.]+ s$", out, re.MULTILINE), out
    rounds = re.findall(r"^round (\d) ([ab]): wall s ([\d.e-]+), router ms/token [\d.e-]+, worker", out, re.M)
    assert [(r, side) for r, side, _ in rounds] == [("0", "a"), ("0", "b"), ("1", "b"), ("1", "a")], out
    assert all(float(wall) > 0 for _, _, wall in rounds)
    for name in ("wall s", "router ms/token", "worker serving ms/token"):
        assert re.search(rf"^median {name}: a [\d.e-]+, b [\d.e-]+, b / a ([\d.]+|-)$", out, re.MULTILINE), (
            out
        )


def test_a_burst_prints_only_its_wall(tmp_path, capsys):
    model = make_tiny_llama(tmp_path / "tiny")
    assert served_ab.main(["--model", str(model), "--load", "burst", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^round 0 a: wall s [\d.e-]+$", out, re.MULTILINE), out
    assert re.search(r"^median wall s: a [\d.e-]+, b [\d.e-]+, b / a [\d.]+$", out, re.MULTILINE), out
    assert "router ms/token" not in out
