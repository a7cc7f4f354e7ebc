"""`python -m benchmarks.run --quick --suites engine_step` on a tiny model: it runs, writes its report,
and reports every target of the engine-step part of the performance issue with a measured figure; a
failed or silent request ends the measurement naming it instead of hanging it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from benchmarks.suites import engine_step
from kvpact.worker.engine.request import GenerationError
from tests.factories.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {
    "paged >= eager (decode step, 32 sequences)",
    "32-sequence decode step outside the matmuls (paged)",
    "32-sequence decode step outside the matmuls (eager)",
    "batch-1 decode step / its matmuls (paged)",
    "batch-1 decode step / its matmuls (eager)",
}


def test_quick_engine_step_suite_writes_its_tables_targets_and_plot(tmp_path):
    model = make_tiny_llama(tmp_path / "model")
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--suites", "engine_step"]
        + ["--model", str(model), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for suffix in (".md", ".json", ".png"):
        assert (out / f"engine_step{suffix}").stat().st_size > 0
    result = json.loads((out / "engine_step.json").read_text())
    assert {t["name"] for t in result["targets"]} == TARGETS
    assert all(t["measured"] and t["met"] in (True, False) for t in result["targets"])
    steps = result["tables"][0]
    assert [(r[0], r[1]) for r in steps["rows"]] == [("paged", 32), ("paged", 1), ("eager", 32), ("eager", 1)]
    for row in steps["rows"]:
        assert row[2] > 0 and row[3] > 0 and row[6] > 0  # step ms, matmuls ms, steps timed
    # paged >= eager is judged on the step ratio over the control (the same matmuls alone in both)
    by_cache = {s["cache"]: s for s in result["data"]["scenarios"] if s["sequences"] == 32}
    paged, eager = by_cache["paged"], by_cache["eager"]
    step_ratio = eager["step_ms"] / paged["step_ms"]
    caches = step_ratio / (eager["matmul_ms"] / paged["matmul_ms"])
    judged = next(t for t in result["targets"] if t["name"] == "paged >= eager (decode step, 32 sequences)")
    assert judged["measured"].startswith(f"{caches:.2f} (step ratio {step_ratio:.2f}:")
    assert judged["met"] == (caches >= 1.0)
    groups = {r[2] for r in result["tables"][1]["rows"]}
    assert {"matmul (linear)", "attention kernel", "host (Python, dispatch)"} <= groups
    assert "--suites engine_step --quick" in steps["command"]
    assert "engine_step.png" in (out / "engine_step.md").read_text()


class FailingEngine:
    """Fails every request from another thread, as the engine's step thread does."""

    def submit(self, request, sink) -> None:  # type: ignore[no-untyped-def]
        threading.Thread(target=sink, args=(GenerationError("simulated device fault"),)).start()


class SilentEngine:
    """Accepts requests and never answers."""

    def submit(self, request, sink) -> None:  # type: ignore[no-untyped-def]
        pass


def generated(engine, wait_s: float = 10.0) -> BaseException | None:  # type: ignore[no-untyped-def]
    """Run the suite's `_generate` in a thread bounded by a join timeout; what it raised (None if none)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            engine_step._generate(engine, [[1, 2], [3, 4]], 4, "t", wait_s=wait_s)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert outcome, "_generate() is still waiting"
    return outcome[0]


def test_a_failed_request_ends_the_measurement_naming_it():
    error = generated(FailingEngine())
    assert isinstance(error, RuntimeError)
    assert str(error) == "t: a request failed: simulated device fault"


def test_requests_that_never_finish_time_out():
    error = generated(SilentEngine(), wait_s=0.2)
    assert isinstance(error, TimeoutError)
    assert str(error) == "t: 2 requests did not finish within 0.2 s"
