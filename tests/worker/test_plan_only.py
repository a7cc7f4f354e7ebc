"""`worker --plan-only [--json]`: every feature's pre-load plan and the verdict, with no router and no
weight read (load_model is never called; a real process plans a model whose weight data is garbage)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import replace

import pytest

from kvpact.worker.cli import parse_args
from kvpact.worker.plan_only import make_plan, run_plan_only
from kvpact.worker.startup import engine_setup, follower
from kvpact.worker.startup.device import probe_device


@pytest.fixture
def never_load(monkeypatch):  # type: ignore[no-untyped-def]
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("--plan-only called load_model (or spawned a rank)")

    monkeypatch.setattr(engine_setup, "load_model", refuse)
    monkeypatch.setattr(follower, "load_model", refuse)  # a rank's build
    monkeypatch.setattr(engine_setup, "start_ranks", refuse)


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
        "quant-kernels": ("auto", "off"),  # a safetensors model
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


@pytest.mark.parametrize("size", [1, 2])
def test_a_real_plan_only_process_reads_no_weight_data(tiny_llama, tmp_path, size):
    """The weights' bytes after the safetensors header are garbage: the plan reads only the header (at
    --tensor-parallel-size 2 too, for every rank)."""
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
            "--tensor-parallel-size",
            str(size),
            "--plan-only",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "verdict: ok (exit 0)" in done.stdout
    assert "cuda-graphs     auto       off      [device] no-cuda-device" in done.stdout
    rows = [line.split()[:3] for line in done.stdout.splitlines() if line[:1].isdigit()]
    assert rows == ([] if size == 1 else [["0", "cpu", "ok"], ["1", "cpu", "ok"]])


def test_the_json_plan_carries_the_fingerprint_and_the_model_name(tiny_llama, never_load, capsys):
    options = parse_args(["--model", str(tiny_llama), "--max-model-len", "128", "--paged-attn", "on",
                          "--model-name", "tiny", "--pa-cache-dtype", "bfloat16", "--plan-only",
                          "--json"])  # fmt: skip
    assert run_plan_only(options.spec, options.plan_json, options.model_name) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model_name"] == "tiny"
    fingerprint = out["fingerprint"]
    assert sorted(fingerprint) == sorted(
        ["model", "tokenizer", "chat-template", "dtype", "cache-dtype", "max-model-len", "block-size",
         "tensor-parallel-size"]
    )  # fmt: skip
    assert (fingerprint["dtype"], fingerprint["cache-dtype"]) == ("float32", "bfloat16")
    assert fingerprint["model"].startswith("sha256:") and fingerprint["max-model-len"] == 128
    assert (fingerprint["block-size"], fingerprint["tensor-parallel-size"]) == (16, 1)


def planned(features: list[dict]) -> dict[str, tuple[str, str]]:  # type: ignore[type-arg]
    return {f["name"]: (f["requested"], f["planned"]) for f in features}


def test_a_tensor_parallel_plan_reports_every_rank_and_spawns_none(tiny_llama, never_load, capsys):
    code, out = plan_json(capsys, "--model", str(tiny_llama), "--max-model-len", "256", "--paged-attn", "on",
                          "--tensor-parallel-size", "2")  # fmt: skip
    assert (code, out["verdict"], out["tensor_parallel_size"]) == (0, "ok", 2)
    assert [(r["rank"], r["device"], r["verdict"], r["problem"]) for r in out["ranks"]] == [
        (0, "cpu", "ok", None),
        (1, "cpu", "ok", None),
    ]
    for rank in out["ranks"]:  # each rank's own plan, and the worker's: paged on every rank
        assert planned(rank["features"])["paged-attn"] == ("on", "on")
    assert planned(out["features"])["paged-attn"] == ("on", "on")
    assert out["fingerprint"]["tensor-parallel-size"] == 2


def short_of_memory_beyond_rank_0(monkeypatch):  # type: ignore[no-untyped-def]
    """Every rank but 0 probes 64 MiB free (rank 0 keeps the worker's probe): a device with less room."""
    monkeypatch.setattr(
        follower,
        "probe_device",
        lambda device, m=(): replace(probe_device(device), memory_free_bytes=64 << 20),
    )


def test_a_rank_that_cannot_meet_on_refuses_the_worker_naming_the_rank(tiny_llama, never_load, monkeypatch,
                                                                         capsys):  # fmt: skip
    short_of_memory_beyond_rank_0(monkeypatch)
    code, out = plan_json(capsys, "--model", str(tiny_llama), "--max-model-len", "256", "--paged-attn", "on",
                          "--pa-memory-fraction", "0.01", "--tensor-parallel-size", "2")  # fmt: skip
    assert (code, out["verdict"]) == (78, "refused")
    (paged,) = [f for f in out["features"] if f["name"] == "paged-attn"]
    assert paged["planned"] == "off" and paged["reason"]["code"] == "tensor-parallel-rank"
    assert paged["reason"]["message"].startswith("rank 1 (cpu) cannot realize it: the KV cache budget")
    assert [(r["rank"], r["verdict"]) for r in out["ranks"]] == [(0, "ok"), (1, "refused")]
    assert out["ranks"][1]["problem"]["feature"] == "paged-attn"
    assert out["ranks"][1]["problem"]["code"] == "kv-budget"


def test_the_text_plan_has_a_row_per_rank(tiny_llama, never_load, monkeypatch, capsys):
    short_of_memory_beyond_rank_0(monkeypatch)
    options = parse_args(["--model", str(tiny_llama), "--max-model-len", "256", "--paged-attn", "on",
                          "--pa-memory-fraction", "0.01", "--tensor-parallel-size", "2",
                          "--plan-only"])  # fmt: skip
    assert run_plan_only(options.spec, options.plan_json) == 78
    out = capsys.readouterr().out
    assert "RANK  DEVICE  VERDICT  ITS OWN PLAN" in out
    assert (
        "0     cpu     ok       +paged-attn +prefix-caching +cpu-kernels !quant-kernels !cuda-graphs" in out
    )
    assert "1     cpu     refused  paged-attn: [cache-budget] kv-budget: the KV cache budget" in out
    assert "verdict: refused (exit 78)" in out


def test_a_gguf_header_is_parsed_once_for_the_whole_tensor_parallel_plan(tmp_path, never_load, monkeypatch):
    """The config, the weight estimate, the fingerprint and every rank's plan share one parse (it used to
    be one per read and rank: about 0.15 s each for the default model)."""
    from kvpact.worker.loader import gguf_reader
    from tests.factories.tiny_models import make_tiny_gguf

    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    parsed = []
    real = gguf_reader.GGUFContents.__init__

    def counted(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        parsed.append(path)
        real(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf_reader.GGUFContents, "__init__", counted)
    options = parse_args(["--model", str(model), "--max-model-len", "128", "--tensor-parallel-size", "2"])
    verdict = make_plan(options.spec)
    assert (verdict.exit_code, len(verdict.ranks)) == (0, 2)
    assert parsed == [model]


def test_an_unreadable_model_exits_1_and_still_says_the_parallel_size(tmp_path, never_load, capsys):
    code, out = plan_json(capsys, "--model", str(tmp_path / "missing"), "--tensor-parallel-size", "2")
    assert (code, out["verdict"], out["tensor_parallel_size"], out["ranks"]) == (1, "refused", 2, [])
    assert out["error"].startswith(f"model path {tmp_path / 'missing'} does not exist")
