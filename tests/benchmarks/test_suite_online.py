"""`python -m benchmarks.run --quick --suites online` on the tiny model: both caches serve every rate through
a real router, and the report gives TTFT and inter-token latency percentiles and where p99 TTFT passes 2 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import run_quick_suite

TIMEOUT_S = 240


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_online_suite_on_the_tiny_model(tmp_path: Path) -> None:
    report = run_quick_suite("online", tmp_path, timeout_s=TIMEOUT_S)

    latency, crossing = report["tables"]
    assert latency["command"] == "python -m benchmarks.run --suites online --quick"
    assert latency["columns"][:3] == ["cache", "rate req/s", "requests"]
    rows = latency["rows"]
    assert [row[0] for row in rows] == ["paged", "paged", "eager", "eager"]
    assert [row[1] for row in rows[:2]] == [row[1] for row in rows[2:]]  # the same rates for both caches
    assert rows[0][1] < rows[1][1]
    for row in rows:
        assert row[2] >= 3, row
        ttft, itl = row[3:6], row[6:9]
        assert 0 < ttft[0] <= ttft[1] <= ttft[2], row
        assert 0 <= itl[0] <= itl[1] <= itl[2] and itl[2] > 0, row
        assert row[9] > 0, row  # output tok/s

    assert [row[0] for row in crossing["rows"]] == ["paged", "eager"]
    assert all("req/s" in row[1] for row in crossing["rows"])
    assert report["data"]["capacity_req_s"] > 0
