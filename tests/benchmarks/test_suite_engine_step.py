"""`python -m benchmarks.run --quick --suites engine_step` on a tiny model: it runs, writes its report,
and reports every target of the engine-step part of the performance issue with a measured figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.factories.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {
    "paged >= eager (decode step, 32 sequences)",
    "32-sequence decode step outside the matmuls (paged)",
    "32-sequence decode step outside the matmuls (eager)",
    "batch-1 decode step / its matmuls (paged)",
    "batch-1 decode step / its matmuls (eager)",
}


def test_quick_engine_step_suite_writes_its_tables_targets_and_plot(tmp_path):
    model = make_tiny_llama(tmp_path / "model")
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--suites", "engine_step"]
        + ["--model", str(model), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for suffix in (".md", ".json", ".png"):
        assert (out / f"engine_step{suffix}").stat().st_size > 0
    result = json.loads((out / "engine_step.json").read_text())
    assert {t["name"] for t in result["targets"]} == TARGETS
    assert all(t["measured"] and t["met"] in (True, False) for t in result["targets"])
    steps = result["tables"][0]
    assert [(r[0], r[1]) for r in steps["rows"]] == [("paged", 32), ("paged", 1), ("eager", 32), ("eager", 1)]
    for row in steps["rows"]:
        assert row[2] > 0 and row[3] > 0 and row[6] > 0  # step ms, matmuls ms, steps timed
    groups = {r[2] for r in result["tables"][1]["rows"]}
    assert {"matmul (linear)", "attention kernel", "host (Python, dispatch)"} <= groups
    assert "--suites engine_step --quick" in steps["command"]
    assert "engine_step.png" in (out / "engine_step.md").read_text()
