"""Runs triton_cases.py in a subprocess per kernel group.

Without CUDA the kernels run under TRITON_INTERPRET=1, where a bad out-of-bounds access kills
the process: a subprocess turns that into one failed test (with the output) instead of a dead
session. The env var must be set before triton is imported, which a fresh process guarantees.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("triton_cases.py")
INTERPRETED_GROUPS = ["cache_write", "decode", "prefill", "checks"]
COMPILED_GROUPS = "checks or cuda_compile"  # on CPU: the CPU-tensor check and the CUDA compiler


def run_cases(keyword: str, marker: str, interpret: bool) -> None:
    import torch

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(CASES),
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        keyword,
        "-m",
        marker,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    report = f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-8000:]}\n{done.stderr[-4000:]}"
    if done.returncode != 0 or " passed" not in done.stdout:  # a run that only skips proves nothing
        pytest.fail(report)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", INTERPRETED_GROUPS)
def test_triton_kernels(group):
    run_cases(group, "not slow", interpret=True)


@pytest.mark.timeout(600)
def test_compiled_kernels_checks_and_cuda_compile():
    run_cases(COMPILED_GROUPS, "not slow", interpret=False)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("group", ["decode", "prefill"])  # the groups with slow cases
def test_triton_kernels_slow(group):
    run_cases(group, "slow", interpret=True)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_cuda_compile_slow():
    run_cases(COMPILED_GROUPS, "slow", interpret=False)
