"""The router suite runs end to end on the tiny model (`--quick`): real router, synthetic and real
worker processes, load clients; it writes its report, JSON and plot, every table has its rows with
positive figures, and every router target of the performance issue is listed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories.tiny_models import make_tiny_llama

REPO = Path(__file__).resolve().parents[2]
TARGETS = {
    "router capacity, 256 streams",
    "router capacity, 256 streams, engine steps",
    "added p99 latency, 64 x 50 tokens/s",
    "real model: router vs direct",
    "router tier on several cores",
    "HTTP vs gRPC, tokens per router CPU-s",
    "HTTP added p99 latency, 64 x 50 tokens/s",
}


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
@pytest.mark.timeout(240)
def test_quick_router_suite_writes_its_tables_targets_and_plot(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "benchmarks.run", "--quick", "--suites", "router", "--model", str(model)]
    done = subprocess.run([*argv, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for suffix in (".md", ".json", ".png"):
        assert (out / f"router{suffix}").stat().st_size > 0
    result = json.loads((out / "router.json").read_text())
    assert {t["name"] for t in result["targets"]} == TARGETS
    for target in result["targets"]:  # judged, or (a loaded machine's latency) said why not
        assert target["met"] in (True, False) or "not judged" in target["note"], target
    tables = {t["title"].split(":", 1)[1].split(",")[0].strip(): t for t in result["tables"]}
    latency = tables["added latency per token"]
    paths = ["direct to the worker", "through the router", "through the router, HTTP/SSE"]
    assert [r[0] for r in latency["rows"]] == paths + [p + ", lockstep" for p in paths]
    assert all(r[1] > 0 and r[2] > 0 for r in latency["rows"])  # tokens, p50 latency
    capacity = tables["capacity"]
    assert {(r[0], r[1]) for r in capacity["rows"]} == {
        (64, "direct"), (64, "router"), (64, "router, HTTP"), (256, "direct"), (256, "router"),
        (256, "router, HTTP"), (256, "direct, engine steps"), (256, "router, engine steps"),
        (256, "router, asyncio"),
    }  # fmt: skip
    assert all(r[2] > 0 for r in capacity["rows"])  # tokens/s on every path
    assert [r[0] for r in tables["scale-out (256 full-speed streams)"]["rows"]] == [
        "1 router",
        "2 routers",
    ]
    # Two routers: the client's streams reached both (each router has its own synthetic worker).
    by_worker = result["data"]["scale_out"]["2 routers"]["tokens_by_worker"]
    assert set(by_worker) == {"synthetic-0", "synthetic-1"} and min(by_worker.values()) > 0, by_worker
    real = next(t for t in result["tables"] if "a real model" in t["title"])
    assert [r[0] for r in real["rows"]] == ["direct to the worker", "through the router"]
    assert all(r[1] > 0 for r in real["rows"])
    assert "python -m benchmarks.run --suites router --quick" in (out / "router.md").read_text()
