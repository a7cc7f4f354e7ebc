"""benchmarks.run itself: suite names are checked, and summary.md lists every suite whose results are
in the folder (a rerun of one suite keeps the others' lines). The suites' own runs are tested in
test_suite_<name>.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *args], capture_output=True, text=True, timeout=120
    )


def test_an_unknown_suite_is_a_usage_error_naming_the_suites() -> None:
    proc = run("--suites", "offline,nope")
    assert proc.returncode == 2
    assert "unknown suite(s) nope; choose from engine_step, offline" in proc.stderr


def test_the_summary_keeps_every_suite_already_in_the_folder(tmp_path: Path) -> None:
    for name in ("offline", "failfast"):
        shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    shutil.copytree(RESULTS / "gpu_h200", tmp_path / "gpu_h200")
    proc = run("--suites", "", "--out", str(tmp_path), "--model", str(tmp_path / "model.gguf"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    rows = [
        line
        for line in summary.splitlines()
        if line.startswith("| offline |") or line.startswith("| failfast |")
    ]
    assert len(rows) == 2, summary
    for row in rows:  # each suite's own machine, whatever machine wrote the summary
        name = row.split("|")[1].strip()
        assert f"| {json.loads((tmp_path / f'{name}.json').read_text())['machine']['cpu']} |" in row
    for name in ("offline", "failfast"):
        saved = json.loads((tmp_path / f"{name}.json").read_text())
        for target in saved["targets"]:
            assert f"| {target['name']} | {target['goal']} |" in summary
    # no row for a suite that is not in the folder (a kept suite's command may still name it)
    assert "[failfast.md](failfast.md)" in summary and "| engine_step |" not in summary
    gpu = json.loads((tmp_path / "gpu_h200" / "targets.json").read_text())  # the GPU check's row and targets
    assert f"| gpu_check (gpu_h200) | `{gpu['command']}` | {gpu['machine']['cpu']} | 177 | 2/3 |" in summary
    for target in gpu["targets"]:
        assert f"| {target['name']} | {target['goal']} | {target['measured']}" in summary
