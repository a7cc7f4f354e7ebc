"""`python -m benchmarks.run --quick --suites step_budget` on the tiny model: every budget runs the same
requests, the default budget is among them, and the ITL target is measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import run_quick_suite


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_step_budget_suite_runs_every_budget_on_the_same_load(tmp_path: Path):
    from kvpact.worker.kv.sizing import CPU_DEFAULTS

    result = run_quick_suite("step_budget", tmp_path, timeout_s=300)
    budgets = [r["budget"] for r in result["data"]["runs"]]
    assert budgets[0] == 0 and 2048 in budgets  # the default's row (no flag) first, then the flags
    assert budgets[1:] == sorted(budgets[1:], reverse=True)
    assert all(
        r["output_tok_s"] > 0 and r["itl_ms"]["99"] >= r["itl_ms"]["50"] for r in result["data"]["runs"]
    )
    (target,) = result["targets"]
    assert target["met"] in (True, False) and "median step" in target["measured"]
    beside = CPU_DEFAULTS.prompt_tokens_beside_decodes
    assert f"at most {beside} prompt tokens beside decodes" in target["name"]
