"""benchmarks/probes/*.c (the bf16 and Q4_1 probes docs/performance.md quotes) build with the C kernels'
flags, check their layouts against float32 before timing, and print their one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpact.kernels import cpu_paged

PROBES = Path(__file__).resolve().parents[2] / "benchmarks" / "probes"
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")

AVX512 = " avx512f" in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("probes")
    names = ("bf16_panels", "bf16_kv", *(("q4_panels",) if AVX512 else ()))
    return {name: build(name, out) for name in names}


def build(name: str, out: Path) -> Path:
    """The probe compiled as an executable with the C kernels' CFLAGS (less the shared-library ones)."""
    flags = [f for f in cpu_paged.CFLAGS if f not in ("-shared", "-fPIC")]
    exe = out / name
    subprocess.run(
        [str(COMPILER), *flags, "-o", str(exe), str(PROBES / f"{name}.c"), "-lm"], check=True, timeout=120
    )
    return exe


PANELS = [("bf16_panels", layout, "14|7") for layout in ("fp32", "bf16", "bf16p")] + [
    pytest.param("q4_panels", layout, "14|3", marks=pytest.mark.skipif(not AVX512, reason="needs AVX-512"))
    for layout in ("fp32", "q4", "q4s")
]


@pytest.mark.parametrize(("probe", "layout", "megabytes"), PANELS)
def test_a_panels_probe_agrees_with_float32_then_times_a_step(built, probe, layout, megabytes):
    # one layer, no LM head: a short run beside the rest of the suite
    done = subprocess.run(
        [str(built[probe]), "3", layout, "1", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(
        rf"{layout} rows 3: best [\d.]+ ms a step, ({megabytes}) MB of weights \([\d.]+ GB/s\)\n", done.stdout
    )


@pytest.mark.parametrize("layout", ["fp32", "bf16"])
def test_bf16_kv_agrees_with_float32_then_times_a_step(built, layout):
    done = subprocess.run(
        [str(built["bf16_kv"]), layout, "1", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"{layout}: best [\d.]+ ms a step, (11|5) MB of K/V \([\d.]+ GB/s\)\n", done.stdout)
