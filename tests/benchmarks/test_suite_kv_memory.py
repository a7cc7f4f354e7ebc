"""`python -m benchmarks.run --quick --suites kv_memory` on the tiny model: it runs, writes its report,
and measures both targets with figures a reader can trust (the suite cannot rot unnoticed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import run_quick_suite


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_kv_memory_suite_reports_both_caches_the_prefix_cache_and_its_targets(tmp_path: Path):
    result = run_quick_suite("kv_memory", tmp_path, timeout_s=180)
    budget, prefix = result["tables"]
    rows = {row[0]: dict(zip(budget["columns"], row, strict=True)) for row in budget["rows"]}
    assert set(rows) == {"paged", "eager"}  # --quick leaves out the --pa-block-size 8 run
    paged, eager = rows["paged"], rows["eager"]
    assert paged["budget MiB"] == eager["budget MiB"] > 0  # one budget for both caches
    assert eager["peak running"] == 2  # two eager slots fit the budget, by construction
    assert paged["peak running"] > eager["peak running"]
    for row in (paged, eager):
        assert 0 < row["real tokens at peak %"] <= 100
        assert 0 < row["tokens held at peak"] <= row["allocated tokens at peak"]
    assert paged["real tokens at peak %"] > eager["real tokens at peak %"]

    by_mode = {row[0].split()[0]: dict(zip(prefix["columns"], row, strict=True)) for row in prefix["rows"]}
    assert set(by_mode) == {"on", "off"}
    assert by_mode["off"]["cached prompt tokens"] == 0
    assert by_mode["on"]["hit rate %"] > 50  # the warmed system prompt is served from the cache
    assert by_mode["on"]["prompt tokens"] == by_mode["off"]["prompt tokens"] > 0
    assert all(row["processed tok/s"] > 0 for row in by_mode.values())

    names = [t["name"] for t in result["targets"]]
    assert any(n.startswith("KV memory holding real tokens at peak") for n in names), names
    assert any(n.startswith("concurrency at a fixed KV budget") for n in names), names
    assert all(t["met"] in (True, False) and t["measured"] for t in result["targets"])
