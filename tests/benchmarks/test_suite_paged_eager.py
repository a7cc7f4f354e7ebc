"""`python -m benchmarks.run --quick --suites paged_eager` on the tiny model: both cases run on both caches,
the out-of-slots case really runs out of eager slots (one KV budget, more requests than slots), and both
targets are measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import run_quick_suite


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_paged_eager_suite_compares_both_caches_on_long_prompts_and_past_the_eager_slots(
    tmp_path: Path,
):
    result = run_quick_suite("paged_eager", tmp_path, timeout_s=240)
    (table,) = result["tables"]
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["rows"]]
    assert [(r["case"], r["cache"]) for r in rows] == [
        ("long_prompt", "paged"),
        ("long_prompt", "eager"),
        ("8 requests, 2 eager slots", "paged"),
        ("8 requests, 2 eager slots", "eager"),
    ]
    assert all(r["wall s"] > 0 and r["output tok/s"] > 0 for r in rows)
    slots_paged, slots_eager = rows[2]["flags"], rows[3]["flags"]
    assert "--max-num-seqs 2 " in slots_eager and "--max-num-seqs 8 " in slots_paged
    assert "--pa-memory-bytes" in slots_paged  # the budget of the two eager slots
    names = [t["name"] for t in result["targets"]]
    assert names == [
        "paged >= eager, long_prompt, in-process (own-K/V prefill)",
        "paged >= eager where the eager cache runs out of slots (one KV budget)",
    ]
    assert all(t["met"] in (True, False) and t["measured"] for t in result["targets"])
    assert set(result["data"]["ratios"]) == {"long_prompt", "8 requests, 2 eager slots"}
