"""The engine's TRITON paged backend runs end to end (Triton interpreter on the CPU) and produces the
torch backend's greedy tokens: the wiring from PagedCache to the kernels is the same on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_triton_backend_engine_matches_torch_backend(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.worker.triton_engine_case", str(tmp_path / "model")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [len(t) for t in result["triton"]] == [6, 6, 6]
    assert result["triton"] == result["torch"]
    assert result["triton_free_blocks"] == result["torch_free_blocks"] == 16
