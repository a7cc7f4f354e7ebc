"""worker.kernel_check: the Triton kernels' startup self-test passes when they match the torch
references and otherwise names what failed, on which device, and the flag that avoids them."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvpact.worker.kv.paged import reference_ops
from kvpact.worker.startup.kernel_check import triton_self_test

ROOT = Path(__file__).resolve().parents[2]
SHAPES = dict(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
TORCH_OPS = reference_ops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_that_match_the_references_pass(dtype):
    assert triton_self_test(torch.device("cpu"), dtype, **SHAPES, ops=TORCH_OPS) is None


def test_a_kernel_off_the_reference_is_named_with_its_error():
    def half_decode(*args, **kwargs):
        return TORCH_OPS.decode(*args, **kwargs) * 0.5

    reason = triton_self_test(
        torch.device("cpu"), torch.float16, **SHAPES, ops=replace(TORCH_OPS, decode=half_decode)
    ).message
    assert reason.startswith(
        "the Triton paged kernels' decode attention (1 split) is off the torch reference by "
    )
    assert "(more than 0.01 in float16) in a startup self-test on cpu" in reason
    assert reason.endswith("(--pa-backend torch runs PagedAttention without them)")


def test_a_kernel_that_writes_nan_fails():
    def nan_prefill(*args, **kwargs):
        return torch.full_like(TORCH_OPS.prefill(*args, **kwargs), float("nan"))

    reason = triton_self_test(
        torch.device("cpu"), torch.float32, **SHAPES, ops=replace(TORCH_OPS, prefill=nan_prefill)
    ).message
    assert "prefill attention is off the torch reference by nan" in reason


def test_a_kernel_that_raises_is_named_with_the_error():
    def broken_write(*args, **kwargs):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_120\nmore detail")

    reason = triton_self_test(
        torch.device("cpu"), torch.float32, **SHAPES, ops=replace(TORCH_OPS, write=broken_write)
    ).message
    assert reason == (
        "the Triton paged kernels failed a startup self-test on cpu: RuntimeError: PTX .version 8.7 does not "
        "support .target sm_120 (--pa-backend torch runs PagedAttention without them)"
    )


def test_the_triton_kernels_pass_under_the_interpreter():
    """The real Triton kernels, in a fresh process with TRITON_INTERPRET=1 (set before triton is
    imported): the self-test's own inputs are valid for them, GQA and bf16 included."""
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from kvpact.worker.startup.kernel_check import triton_self_test\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    print(repr(triton_self_test(torch.device('cpu'), dtype, num_heads=6, num_kv_heads=2,"
        " head_dim=64, block_size=16)))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["None", "None"], proc.stdout
