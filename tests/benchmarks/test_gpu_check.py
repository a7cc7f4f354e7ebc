"""benchmarks/gpu_check.sh: the script a GPU session gets one try with runs every step here, on the
CPU with CPU expectations (--dry-run), so a typo cannot spend that try."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = [
    "a) environment",
    "b) kernel tests",
    "c) benchmarks/kernels.py",
    "d) engine",
    "e) end to end",
    "f) host time",
    "g) --device-map",
    "h) tensor parallel",
    "i) cuda graphs",
]


def dry_run(out: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """gpu_check.sh --dry-run writing to `out`, with `env` added: the process and its summary.txt."""
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        cwd=ROOT,
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=540,
    )
    return proc, (out / "summary.txt").read_text()


@pytest.mark.timeout(600)
def test_the_gpu_check_dry_run_passes_every_step(tmp_path):
    pytest.importorskip("triton")
    proc, summary = dry_run(tmp_path, GPU_CHECK_BUDGET_S="480")
    assert proc.returncode == 0, summary + proc.stdout[-4000:] + proc.stderr[-4000:]
    for step in STEPS:
        assert any(line.startswith(f"PASS  {step}") for line in summary.splitlines()), (step, summary)
    assert "RESULT e2e: PASS on: paged/torch; auto: eager/None" in summary  # on-torch is on, on a CPU
    graphs = "RESULT graphs: PASS cpu --cuda-graphs auto: no-cuda-device; cpu --cuda-graphs on: exit 78"
    assert graphs in summary
    assert "float32 batch 4 graphs on vs off: max logit diff" in summary  # the static path, judged by logits
    assert "tokens/s on " in summary and "RESULT host: PASS 0 compiles after the warm-up" in summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a_env.txt",
        "b_kernels.txt",
        "c_bench.txt",
        "d_engine.txt",
        "e_e2e.txt",
        "f_host.txt",
        "g_device_map.txt",
        "h_tp.txt",
        "i_graphs.txt",
        "summary.txt",
    ]


def test_gpu_check_only_runs_the_steps_it_names(tmp_path):
    proc, summary = dry_run(tmp_path, GPU_CHECK_ONLY="f")
    assert proc.returncode == 0, summary + proc.stderr[-4000:]
    lines = summary.splitlines()
    assert any(line.startswith("PASS  f) host time") for line in lines), summary
    for step in ("b) kernel tests", "d) engine", "e) end to end", "i) cuda graphs"):
        assert any(line.startswith(f"SKIP  {step}") and "not in GPU_CHECK_ONLY=f" in line for line in lines)
    assert not (tmp_path / "d_engine.txt").exists()
