"""`python benchmarks/plan_time.py` on a tiny GGUF model, as a user runs it: exit 0 and the table's rows
(the benchmark cannot rot unnoticed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import ROOT
from tests.factories.tiny_models import make_tiny_gguf


@pytest.mark.slow  # a second torch import in a subprocess; tests/worker/test_plan_only.py counts the parses
def test_plan_time_prints_the_reads_and_each_sizes_plan(tmp_path: Path):
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    argv = [sys.executable, "benchmarks/plan_time.py", "--model", str(model), "--sizes", "1", "2",
            "--repeat", "1", "--cold"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^\| (.+?) \| (\d+\.\d{3}) \|$", done.stdout, flags=re.MULTILINE))
    assert list(rows) == [
        "config + weight estimate + fingerprint, read apart (before)",
        "the model's header, read once (now)",
        "make_plan, --tensor-parallel-size 1",
        "make_plan, --tensor-parallel-size 2",
    ], done.stdout
