"""`python -m benchmarks.run --quick --suites step_budget` on the tiny model: every row runs the same
requests, the default (no flag) first, and the ITL target is measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import run_quick_suite


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_step_budget_suite_runs_every_row_on_the_same_load(tmp_path: Path):
    from kvpact.worker.kv.sizing import CPU_DEFAULTS

    result = run_quick_suite("step_budget", tmp_path, timeout_s=300)
    runs = result["data"]["runs"]
    assert [r["flags"] for r in runs[:2]] == [[], ["--max-num-batched-tokens", "2048"]]  # default, old
    assert all(r["output_tok_s"] > 0 and r["itl_ms"]["99"] >= r["itl_ms"]["50"] for r in runs)
    (target,) = result["targets"]
    assert target["met"] in (True, False) and "median step" in target["measured"]
    beside = CPU_DEFAULTS.prompt_tokens_beside_decodes
    assert f"at most {beside} prompt tokens beside decodes" in target["name"]
