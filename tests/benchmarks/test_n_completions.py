"""`python -m benchmarks.n_completions --quick` on the tiny model, as a user runs it: exit 0, the table,
and the figures PagedAttention's sharing implies (the benchmark cannot rot unnoticed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import ROOT
from tests.factories.tiny_models import make_tiny_llama


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_n_completions_shares_the_prompt_blocks_and_prefills_once(tmp_path: Path):
    model = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "n.json"
    argv = [
        sys.executable,
        "-m",
        "benchmarks.n_completions",
        "--quick",
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| n=4 |" in done.stdout
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    together, apart = rows["n=4"], rows["4 requests, no prefix cache"]
    # 40-token prompt + 8 tokens, blocks of 16: n=4 holds 2 shared full blocks + 4 private last blocks;
    # 4 requests hold 3 blocks each
    assert (together["peak_blocks"], apart["peak_blocks"]) == (6, 12)
    assert (together["prompt_tokens_computed"], apart["prompt_tokens_computed"]) == (40, 160)
    assert together["completion_tokens"] == apart["completion_tokens"] == 32
