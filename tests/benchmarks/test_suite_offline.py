"""`python -m benchmarks.run --quick --suites offline` on the tiny model: every system runs every workload,
the report names every target, and kvpact's greedy tokens are transformers' (so the suite compares the
same work)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import run_quick_suite

TIMEOUT_S = 240


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_offline_suite_on_the_tiny_model(tmp_path: Path) -> None:
    report = run_quick_suite("offline", tmp_path, timeout_s=TIMEOUT_S)

    throughput = {t["title"]: t for t in report["tables"] if t["title"].startswith("Offline throughput")}
    assert sorted(throughput) == [
        f"Offline throughput, {w} workload" for w in ("long_prompt", "mixed", "shared_prefix")
    ]
    mixed = throughput["Offline throughput, mixed workload"]
    assert [row[0] for row in mixed["rows"]] == [
        "kvpact paged, router + worker",
        "kvpact eager, router + worker",
        "kvpact paged, in-process",
        "kvpact eager, in-process",
        "transformers generate, one padded batch",
        "transformers generate, batches of 8",
        "transformers continuous batching",
    ]
    for table in throughput.values():
        assert table["command"] == "python -m benchmarks.run --suites offline --quick"
        for row in table["rows"]:
            assert all(value > 0 for value in row[1:4]), row  # wall s, output tok/s, processed tok/s

    bounds = report["data"]["compute_bound"]
    assert len(bounds) == 2 and all(b["tokens_per_s"] > 0 for b in bounds)

    names = [t["name"] for t in report["targets"]]
    assert names == [
        "offline mixed, router + worker, paged vs transformers one padded batch",
        "offline mixed, router + worker, paged vs transformers continuous batching",
        "offline mixed, router + worker, paged: processed tokens / compute bound",
        "paged >= eager on every offline workload (router + worker)",
        "two hand-started workers on this machine vs one alone (output tok/s, no thread flags)",
    ]
    assert all(t["met"] in (True, False) and t["measured"] for t in report["targets"])
    shared = {t["title"]: t for t in report["tables"]}[
        "Workers sharing this machine (router + N hand-started paged workers, no thread flags)"
    ]
    assert [row[0] for row in shared["rows"]] == [1, 2]
    assert all(row[2] > 0 for row in shared["rows"])  # both runs delivered every token

    # The tiny model's logits are far from ties: every system generates transformers' tokens exactly.
    agreement = report["data"]["agreement"]
    assert agreement and all(a["identical"] == a["of"] for a in agreement), agreement
