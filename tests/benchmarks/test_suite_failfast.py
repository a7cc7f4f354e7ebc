"""`python -m benchmarks.run --quick --suites failfast` on the tiny model: a real router and two real
workers, one refused; the report times the router's failure report and exit and says the Ray path was
skipped (the suite cannot rot unnoticed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.quick_suite import run_quick_suite


@pytest.mark.slow  # one quick suite (engine_step) runs by default; this one in make test-all
def test_quick_failfast_suite_times_the_cli_path_and_says_ray_was_skipped(tmp_path: Path):
    result = run_quick_suite("failfast", tmp_path, timeout_s=180)
    (table,) = result["tables"]
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["rows"]]
    cli, ray = rows
    assert cli["path"] == "CLI" and cli["router exit code"] == 78  # the policy failure's exit code
    assert cli["every known worker told"] == "yes"
    assert "healthy: sent" in cli["report's shutdown lines"]
    assert 0 < cli["worker report -> router report s"] <= cli["-> router exit s"]
    assert ray["path"] == "Ray" and "skipped in --quick" in ray["report's shutdown lines"]
    (target,) = result["targets"]
    assert target["name"].startswith("fail-fast") and target["met"] in (True, False)
    assert "CLI" in target["measured"]


def test_a_run_that_missed_a_worker_keeps_its_processes_output_and_a_told_one_does_not(tmp_path: Path):
    from benchmarks.suites.failfast import FailRun, _keep_missed_logs

    def run(name: str, healthy: str) -> FailRun:
        logs = tmp_path / "scratch" / name
        logs.mkdir(parents=True)
        (logs / "healthy.stderr").write_text(f"{name}'s healthy worker log\n")
        shutdown = {"healthy": healthy, "refused": "already gone (its startup failed; it exits on its own)"}
        return FailRun("CLI", 78, 0.0, 0.8, 0.9, shutdown=shutdown, logs=logs)

    runs = [run("told", "sent"), run("missed", "could not be told (DEADLINE_EXCEEDED: Deadline Exceeded)")]
    notes = _keep_missed_logs(runs, tmp_path / "out" / "failfast-logs")
    kept = tmp_path / "out" / "failfast-logs" / "cli-2"
    assert notes == [f"run 2 (CLI) did not tell every worker: its processes' output is in {kept}"]
    assert (kept / "healthy.stderr").read_text() == "missed's healthy worker log\n"
    assert sorted(p.name for p in (tmp_path / "out" / "failfast-logs").iterdir()) == ["cli-2"]


def test_a_worker_told_on_a_retry_counts_as_told_with_how_long_after_the_report():
    from benchmarks.suites.failfast import FailRun, _shutdown_lines

    report = "\n".join(
        [
            '{"event": "cluster_failed", "timestamp": "2026-12-08T00:19:34.809000Z"}',
            "kvpact router: the cluster FAILED to start (--paged-attn on, --expect-workers 2, 0 admitted)",
            'worker "healthy" at 127.0.0.1:1, model m: LOADING',
            "  shutdown:  could not be told (DEADLINE_EXCEEDED: Deadline Exceeded); asked again while the "
            "router lingers",
            'worker "refused" at 127.0.0.1:2, model m: FAILED',
            "  shutdown:  already gone (its startup failed; it exits on its own)",
            "exit code 78: the --paged-attn policy cannot be honored by every worker",
        ]
    )
    untold = _shutdown_lines(report)
    assert untold["healthy"].startswith("could not be told")
    assert not FailRun("CLI", 78, 0.0, 0.8, 0.9, shutdown=untold).all_told
    retried = json.dumps(
        {
            "event": "worker_told_cluster_failed",
            "worker_id": "healthy",
            "retried": True,
            "timestamp": "2026-12-08T00:19:35.509000Z",
        }
    )
    told = _shutdown_lines(report + "\n" + retried.replace('"retried"', '"shutdown": "sent", "retried"'))
    assert told["healthy"].startswith(
        "told on a retry (sent), 0.70 s after the report (the report said: could"
    )
    assert FailRun("CLI", 78, 0.0, 0.8, 0.9, shutdown=told).all_told
    registered = _shutdown_lines(report + "\n" + retried.replace(', "retried": true', ""))
    assert registered["healthy"].startswith(
        "told when it registered again (refused), 0.70 s after the report"
    )
    assert FailRun("CLI", 78, 0.0, 0.8, 0.9, shutdown=registered).all_told
