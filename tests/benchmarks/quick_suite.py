"""Run one benchmark suite's `--quick` on the tiny model, the way a user would, and read its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.factories.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def run_quick_suite(suite: str, tmp_path: Path, timeout_s: float = 240) -> dict[str, Any]:
    """`python -m benchmarks.run --quick --suites SUITE` on a tiny Llama: asserts exit 0 and that
    SUITE.md, .json and .png were written, and returns the parsed SUITE.json."""
    model = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "benchmarks.run", "--quick", "--suites", suite]
    argv += ["--model", str(model), "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for suffix in (".md", ".json", ".png"):
        assert (out / f"{suite}{suffix}").stat().st_size > 0
    return json.loads((out / f"{suite}.json").read_text())
