"""`worker --plan-only [--json]`: every feature's pre-load plan and the verdict, with no router and no
weight read (load_model is never called; a real process plans a model whose weight data is garbage)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from kvpact.worker.cli import parse_args
from kvpact.worker.plan_only import run_plan_only
from kvpact.worker.startup import engine_setup


@pytest.fixture
def never_load(monkeypatch):  # type: ignore[no-untyped-def]
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("--plan-only called load_model")

    monkeypatch.setattr(engine_setup, "load_model", refuse)


def plan_json(capsys, *argv: str) -> tuple[int, dict]:  # type: ignore[no-untyped-def, type-arg]
    options = parse_args([*argv, "--plan-only", "--json"])
    code = run_plan_only(options.spec, options.plan_json)
    # the plan is the last line (in-process, structlog's default config logs to stdout too)
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_plan_that_meets_the_intent_is_ok_and_names_every_features_reason(tiny_llama, never_load, capsys):
    code, out = plan_json(capsys, "--model", str(tiny_llama), "--max-model-len", "256", "--paged-attn", "on")
    assert (code, out["verdict"], out["exit_code"]) == (0, "ok", 0)
    planned = {f["name"]: (f["requested"], f["planned"]) for f in out["features"]}
    assert planned == {
        "paged-attn": ("on", "on"),
        "prefix-caching": ("auto", "on"),
        "cpu-kernels": ("auto", "on"),
        "cuda-graphs": ("auto", "off"),
    }
    (graphs,) = [f for f in out["features"] if f["name"] == "cuda-graphs"]
    assert graphs["reason"]["code"] == "no-cuda-device"


def test_every_unmet_on_is_refused_with_78_and_the_rest_still_planned(tiny_llama, never_load, capsys):
    argv = ("--model", str(tiny_llama), "--max-model-len", "256", "--paged-attn", "on",
            "--pa-backend", "triton", "--cuda-graphs", "on", "--prefix-caching", "on")  # fmt: skip
    code, out = plan_json(capsys, *argv)
    assert (code, out["verdict"]) == (78, "refused")
    by_name = {f["name"]: f for f in out["features"]}
    assert by_name["paged-attn"]["planned"] == "off" and by_name["paged-attn"]["requested"] == "on"
    assert by_name["paged-attn"]["reason"]["message"].startswith(
        "the Triton paged backend needs a CUDA device"
    )
    assert by_name["cuda-graphs"]["reason"]["message"].startswith("no CUDA device")
    # prefix caching needs the paged cache, which the refused paged-attn did not plan
    assert by_name["prefix-caching"]["planned"] == "off"
    assert by_name["prefix-caching"]["reason"]["code"] == "prefix-cache-needs-paged"


def test_json_without_plan_only_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--json"])
    assert exited.value.code == 2 and "--json goes with --plan-only" in capsys.readouterr().err


def test_a_real_plan_only_process_reads_no_weight_data(tiny_llama, tmp_path):
    """The weights' bytes after the safetensors header are garbage: the plan reads only the header."""
    model = tmp_path / "garbage"
    model.mkdir()
    for f in tiny_llama.iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            (header_len,) = struct.unpack("<Q", data[:8])
            data = data[: 8 + header_len] + b"\xff" * (len(data) - 8 - header_len)
        (model / f.name).write_bytes(data)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpact.worker",
            "--model",
            str(model),
            "--max-model-len",
            "256",
            "--plan-only",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "verdict: ok (exit 0)" in done.stdout
    assert "cuda-graphs     auto       off      [device] no-cuda-device" in done.stdout


def test_the_json_plan_carries_the_fingerprint_and_the_model_name(tiny_llama, never_load, capsys):
    options = parse_args(["--model", str(tiny_llama), "--max-model-len", "128", "--paged-attn", "on",
                          "--model-name", "tiny", "--plan-only", "--json"])  # fmt: skip
    assert run_plan_only(options.spec, options.plan_json, options.model_name) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model_name"] == "tiny"
    fingerprint = out["fingerprint"]
    assert sorted(fingerprint) == sorted(
        ["model", "tokenizer", "chat-template", "max-model-len", "block-size", "tensor-parallel-size"]
    )
    assert fingerprint["model"].startswith("sha256:") and fingerprint["max-model-len"] == 128
    assert (fingerprint["block-size"], fingerprint["tensor-parallel-size"]) == (16, 1)
