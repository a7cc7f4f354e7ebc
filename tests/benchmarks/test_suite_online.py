"""`python -m benchmarks.run --quick --suites online` on the tiny model: both caches serve every rate through
a real router, and the report gives TTFT and inter-token latency percentiles and where p99 TTFT passes 2 s,
and the third-party client (guidellm, installed once into a module-level folder) next to the suite's own."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from benchmarks.thirdparty import DIR_ENV
from tests.benchmarks.quick_suite import run_quick_suite

TIMEOUT_S = 240
INSTALL_S = 900  # the first run installs guidellm (about 3 minutes here)


@pytest.fixture(scope="module")
def clients_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """guidellm's venv for this module: installed by the first suite run, reused by later ones."""
    return tmp_path_factory.mktemp("bench-clients")


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_online_suite_on_the_tiny_model(
    tmp_path: Path, clients_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DIR_ENV, os.environ.get(DIR_ENV, str(clients_dir)))
    report = run_quick_suite("online", tmp_path, timeout_s=TIMEOUT_S + INSTALL_S)

    latency, crossing, clients = report["tables"]
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
    reported = report["targets"][0]  # summary.md lists the crossing with the targets
    assert reported["name"] == "rate at which p99 TTFT passes 2 s (paged, eager)", reported
    assert reported["measured"] == f"paged {crossing['rows'][0][1]}; eager {crossing['rows'][1][1]}", reported
    assert report["data"]["capacity_req_s"] > 0

    assert clients["columns"][1:3] == ["client", "requests"]
    names = [row[1] for row in clients["rows"]]
    targets = [t for t in report["targets"] if t["name"].startswith("third-party client agrees")]
    if names[0].startswith("guidellm not installed: "):  # no PyPI: one line saying so, not a failure
        assert len(names) == 1 and [t["met"] for t in targets] == [None], (names, targets)
        return
    assert names == ["ours (1st)", "guidellm", "ours (2nd)", "guidellm / ours"], names
    runs, ratio = clients["rows"][:3], clients["rows"][3]
    for row in runs:  # concurrency 2, 4 requests, text prompts of <= 32 tokens, 4-12 tokens out
        assert row[0] == 2 and row[2] == 4 and 4 <= row[4] <= 12 and row[5] > 0 and row[6] > 0, row
    assert runs[0][4] == runs[1][4] == runs[2][4], runs  # the same output lengths for both clients
    # ours counts its text prompts with the tokenizer, guidellm reports the server's count of the same
    # kind of prompts (the worker may add a BOS token)
    assert all(0 < row[3] <= 32 for row in runs[::2]) and 0 < runs[1][3] <= 34, runs
    assert all(math.isfinite(r) and r > 0 for r in ratio[5:7]), ratio
    assert len(targets) == 2 and all(t["met"] in (True, False) for t in targets), targets
