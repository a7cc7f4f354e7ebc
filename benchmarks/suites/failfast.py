"""Fail-fast: how long a cluster that cannot honor `--paged-attn on` takes to say so and stop.

    python -m benchmarks.run --suites failfast [--quick]

Two paths, each a router expecting 2 workers under `--paged-attn on`, one worker that can honor it
(`--pa-backend torch`) and one that cannot (`--pa-backend triton` on a CPU: its capability check
refuses it before any weight is read):

    CLI  `router --paged-attn on --expect-workers 2` and two `worker` processes on this machine. The
         healthy worker starts first; the refused one starts once the router has heard from it
         (the router logged `worker_loading` or `worker_admitted` for it), so it is a known worker the
         router must tell to stop.
    Ray  `kvpact-launch --config` with a cluster file like deploy/examples/fail_on.yaml, built for the
         model under test, on a local Ray started here (its own temp dir, RAY_AUTH_MODE=disabled, 1 fake
         GPU that torch cannot see, exactly as a GPU node without a usable device). Skipped in --quick.

Every time comes from this machine's one clock (UTC wall time), at these well-defined points:

    worker report  the refused worker's own `startup failed` log line (JSON, --log-format json): it
                   has decided, and sends Handshake{failed} to the router next
    report         the router's `cluster_failed` log line, written right after the failure report
                   (router/cluster.py: every known worker told to stop, bounded, then the report)
    router exit    CLI: when this process saw the router exit; Ray: the router's `router_exit` log line
    launcher exit  Ray: when this process saw kvpact-launch exit (after its teardown of actors and
                   placement group, then the report and the verdict)

and the report must say `shutdown:  sent` for each worker it names (or, for the worker that reported
its own failure or that the router refused, which exit on their own, `already gone` / `not asked`):
every known worker was told to stop (a worker the report could not tell in time counts as told when
the router told it on a retry while lingering, its `worker_told_cluster_failed` line; the table says
how long after the report). Target (issue 13): report - worker report < 2 s.
A CLI run that did not tell every worker leaves its processes' output under the --out directory
(`failfast-logs/cli-N/`, named in the table's notes): the workers' JSON logs say what each was doing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.framework import BenchContext, SuiteResult, Table, Target, new_figure
from kvpact.deploy.processes import ProcessHandle, start_process, stop, wait_for_exit, wait_for_line
from kvpact.router.connections import NOT_TOLD

NAME = "failfast"
GOAL_S = 2.0
MAX_MODEL_LEN = 256  # the healthy worker's cache stays small; nothing is generated
STEP_TIMEOUT_S = 120.0
REPORT_START = "kvpact router: the cluster FAILED"


@dataclass(slots=True)
class FailRun:
    path: str
    exit_code: int
    worker_report: float  # epoch seconds, see the module docstring
    report: float
    router_exit: float
    launcher_exit: float | None = None
    shutdown: dict[str, str] = field(default_factory=dict)  # worker id -> the report's shutdown line
    logs: Path | None = None  # its processes' output, where a run that missed a worker keeps it

    @property
    def to_report_s(self) -> float:
        return self.report - self.worker_report

    @property
    def to_router_exit_s(self) -> float:
        return self.router_exit - self.worker_report

    @property
    def to_launcher_exit_s(self) -> float | None:
        return None if self.launcher_exit is None else self.launcher_exit - self.worker_report

    @property
    def all_told(self) -> bool:
        return bool(self.shutdown) and all(
            line.startswith(
                ("sent", "told ", "already gone", "not asked (its startup failed", "not asked (its refusal")
            )
            for line in self.shutdown.values()
        )


def run(ctx: BenchContext) -> SuiteResult:
    repeats = 1 if ctx.quick else 3
    scratch = Path(tempfile.mkdtemp(prefix="kvpact-failfast-"))
    runs = [_cli_run(ctx, scratch / f"cli-{i}") for i in range(repeats)]
    ray_note = "skipped in --quick (a local Ray takes longer to start than the whole quick budget)"
    if not ctx.quick:
        try:
            runs.append(_ray_run(ctx, scratch / "ray"))
            ray_note = ""
        except ImportError:
            ray_note = "skipped: ray is not installed (pip install 'kvpact[ray]')"
    kept = _keep_missed_logs(runs, ctx.out_dir / f"{NAME}-logs")
    shutil.rmtree(scratch, ignore_errors=True)  # the processes' logs; kept when a run raised
    suffix = " --quick" if ctx.quick else ""
    command = f"python -m benchmarks.run --suites {NAME}{suffix}"
    rows: list[list[Any]] = []
    for r in runs:
        launcher = r.to_launcher_exit_s
        rows.append(
            [
                r.path,
                r.exit_code,
                round(r.to_report_s, 3),
                "yes" if r.all_told else "NO",
                round(r.to_router_exit_s, 3),
                "-" if launcher is None else round(launcher, 2),
                ", ".join(f"{w}: {s}" for w, s in sorted(r.shutdown.items())),
            ]
        )
    if ray_note:
        rows.append(["Ray", "-", "-", "-", "-", "-", ray_note])
    table = Table(
        title="Fail-fast: a refused worker under --paged-attn on, --expect-workers 2",
        columns=[
            "path",
            "router exit code",
            "worker report -> router report s",
            "every known worker told",
            "-> router exit s",
            "-> kvpact-launch exit s",
            "report's shutdown lines",
        ],
        rows=rows,
        command=command,
        notes=[
            "worker report = the refused worker's own `startup failed` log line; router report = the "
            "router's `cluster_failed` log line, written right after its failure report; router exit: CLI "
            "as seen by this process, Ray the router's `router_exit` log line (all UTC wall time, one clock)",
            "CLI: the healthy worker (--pa-backend torch) is known to the router before the refused one "
            "(--pa-backend triton on CPU) starts",
            "Ray: kvpact-launch on a local Ray (1 fake GPU torch cannot use), its exit after the teardown",
            *kept,
        ],
    )
    worst = max(r.to_report_s for r in runs)
    told = all(r.all_told for r in runs)
    paths = ", ".join(f"{r.path} {r.to_report_s:.2f} s" for r in runs)
    targets = [
        Target(
            "fail-fast: worker report -> router's printed report, every known worker told to stop",
            f"< {GOAL_S:g} s",
            f"worst {worst:.2f} s ({paths})" + ("" if told else "; NOT every worker was told"),
            worst < GOAL_S and told,
            ray_note,
        )
    ]
    return SuiteResult(
        suite=NAME,
        tables=[table],
        targets=targets,
        data={
            "runs": [
                {
                    "path": r.path,
                    "exit_code": r.exit_code,
                    "worker_report": r.worker_report,
                    "report": r.report,
                    "router_exit": r.router_exit,
                    "launcher_exit": r.launcher_exit,
                    "shutdown": r.shutdown,
                }
                for r in runs
            ],
            "ray": ray_note or "measured",
        },
        figure=_figure(runs),
    )


def _keep_missed_logs(runs: list[FailRun], into: Path) -> list[str]:
    """Copy the processes' output of each run that did not tell every worker under `into` (the run's
    --out directory), so the next engineer can read why; a note naming each copy."""
    notes = []
    for i, r in enumerate(runs):
        if r.all_told or r.logs is None or not r.logs.is_dir():
            continue
        target = into / f"{r.path.lower()}-{i + 1}"
        shutil.rmtree(target, ignore_errors=True)  # an earlier run's, into the same --out
        shutil.copytree(r.logs, target)
        notes.append(
            f"run {i + 1} ({r.path}) did not tell every worker: its processes' output is in {target}"
        )
    return notes


# -- the CLI path ---------------------------------------------------------------------------------------


def _worker_argv(ctx: BenchContext, worker_id: str, backend: str, router: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvpact.worker",
        "--model",
        str(ctx.model),
        "--device",
        "cpu",
        "--paged-attn",
        "on",
        "--pa-backend",
        backend,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--listen",
        "127.0.0.1:0",
        "--router",
        router,
        "--router-timeout",
        "60",
        "--worker-id",
        worker_id,
        "--log-format",
        "json",
    ]


def _cli_run(ctx: BenchContext, logs: Path) -> FailRun:
    router_argv = [sys.executable, "-m", "kvpact.router", "--listen", "127.0.0.1:0", "--paged-attn", "on"]
    router_argv += ["--expect-workers", "2", "--startup-timeout", "300", "--log-format", "json"]
    started: list[ProcessHandle] = []
    try:
        router = start_process(router_argv, name="router", log_dir=logs)
        started.append(router)
        address = wait_for_line(router, r"^router listening on (\S+)$", STEP_TIMEOUT_S).group(1)
        healthy = start_process(_worker_argv(ctx, "healthy", "torch", address), name="healthy", log_dir=logs)
        started.append(healthy)
        _wait_event(router, ("worker_loading", "worker_admitted"), "healthy")
        refused = start_process(_worker_argv(ctx, "refused", "triton", address), name="refused", log_dir=logs)
        started.append(refused)
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while router.returncode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        router_exit = time.time()
        if router.returncode is None:
            raise TimeoutError(f"the router did not exit within {STEP_TIMEOUT_S:.0f} s\n{router.output()}")
        for handle in (healthy, refused):
            wait_for_exit(handle, STEP_TIMEOUT_S)
        router_lines = _json_lines(router.stderr())
        return FailRun(
            path="CLI",
            exit_code=router.returncode,
            worker_report=_event_time(_json_lines(refused.stderr()), "startup failed", refused),
            report=_event_time(router_lines, "cluster_failed", router),
            router_exit=router_exit,
            shutdown=_shutdown_lines(router.stderr()),
            logs=logs,
        )
    finally:
        for handle in reversed(started):
            stop(handle, grace_s=10)


# -- the Ray path ---------------------------------------------------------------------------------------


def _ray_run(ctx: BenchContext, logs: Path) -> FailRun:
    import ray  # the ray extra; ImportError -> the caller says it was skipped
    import yaml  # type: ignore[import-untyped]

    logs.mkdir(parents=True, exist_ok=True)
    flags = {
        "model": str(ctx.model),
        "device": "cpu",
        "max-model-len": MAX_MODEL_LEN,
        "log-format": "json",
        "router-timeout": 60,
    }
    cluster = {
        "ray": {"address": "auto", "placement_timeout_s": 60},
        "router": {
            "listen": "127.0.0.1:0",
            "paged_attn": "on",
            "startup_timeout_s": 300,
            "flags": {"log-format": "json"},
        },
        "workers": [
            {
                "name": "torch",
                "replicas": 1,
                "resources": {"num_cpus": 1},
                "flags": {**flags, "pa-backend": "torch"},
            },
            {
                "name": "triton",
                "replicas": 1,
                "resources": {"num_gpus": 1, "num_cpus": 1},
                "flags": {**flags, "pa-backend": "triton"},
            },
        ],
    }
    config = logs / "fail_on.yaml"
    config.write_text(yaml.safe_dump(cluster, sort_keys=False))
    auth = {"RAY_AUTH_MODE": "disabled"}
    previous = {key: os.environ.get(key) for key in auth}
    os.environ.update(auth)
    # Ray's unix sockets live under its temp dir: keep the path short (107-byte limit).
    base = tempfile.gettempdir()
    ray_dir = tempfile.mkdtemp(prefix="kvr-", dir=base if len(base) <= 48 else "/tmp")
    context = ray.init(
        num_cpus=4,
        num_gpus=1,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        _temp_dir=ray_dir,
        log_to_driver=False,
    )
    launch: ProcessHandle | None = None
    try:
        gcs = context.address_info["gcs_address"]  # type: ignore[attr-defined]
        env = {**auth, "RAY_ADDRESS": gcs, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "kvpact.deploy.launch", "--config", str(config)]
        launch = start_process(argv, name="launch", env=env, log_dir=logs)
        code = wait_for_exit(launch, 240)
        launcher_exit = time.time()
        out = launch.stdout()
        router_dir = _match(r"\(placement group kvpact-[0-9a-f]+; logs in (\S+)\)", out, launch)
        triton_dir = _match(
            r"^kvpact-launch: worker triton-0 \(pid \d+\) started in .*\(logs in (\S+)\)$", out, launch
        )
        router_log = (Path(router_dir) / "router.stderr").read_text(errors="replace")
        triton_log = "\n".join(
            p.read_text(errors="replace") for p in sorted(Path(triton_dir).glob("triton-0.*.stderr"))
        )
        router_lines = _json_lines(router_log)
        return FailRun(
            path="Ray",
            exit_code=code,
            worker_report=_event_time(_json_lines(triton_log), "startup failed", launch),
            report=_event_time(router_lines, "cluster_failed", launch),
            router_exit=_event_time(router_lines, "router_exit", launch),
            launcher_exit=launcher_exit,
            shutdown=_shutdown_lines(router_log),
        )
    finally:
        if launch is not None:
            stop(launch, grace_s=60)
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- reading the logs -----------------------------------------------------------------------------------


def _json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return lines


def _event_time(lines: list[dict[str, Any]], event: str, handle: ProcessHandle) -> float:
    for line in lines:
        if line.get("event") == event and "timestamp" in line:
            return datetime.fromisoformat(line["timestamp"]).timestamp()
    raise RuntimeError(f"no {event!r} log line found\n{handle.output()}")


def _wait_event(handle: ProcessHandle, events: tuple[str, ...], worker_id: str) -> None:
    """Until the router logs one of `events` for `worker_id` (bounded)."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in _json_lines(handle.stderr()):
            if line.get("event") in events and line.get("worker_id") == worker_id:
                return
        if handle.returncode is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"the router logged none of {events} for {worker_id!r}\n{handle.output()}")


def _match(pattern: str, text: str, handle: ProcessHandle) -> str:
    found = re.search(pattern, text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"kvpact-launch printed no line matching {pattern!r}\n{handle.output()}")
    return found.group(1)


def _shutdown_lines(router_stderr: str) -> dict[str, str]:
    """worker id -> what the failure report says under `shutdown:` for it; for one the report could not
    tell and the router told while it lingered (its `worker_told_cluster_failed` line: a Shutdown asked
    again and answered, or the worker registering again and refused), "told on a retry (ANSWER)" or "told
    when it registered again (refused)", N s after the report."""
    lines = _json_lines(router_stderr)
    report = next((line for line in lines if line.get("event") == "cluster_failed"), None)
    told = _report_lines(router_stderr)
    for line in lines:
        worker = str(line.get("worker_id", ""))
        if line.get("event") != "worker_told_cluster_failed" or not told.get(worker, "").startswith(NOT_TOLD):
            continue
        how = (
            f"on a retry ({line.get('shutdown')})"
            if line.get("retried")
            else "when it registered again (refused)"
        )
        after = ""
        if report is not None:
            seconds = datetime.fromisoformat(line["timestamp"]) - datetime.fromisoformat(report["timestamp"])
            after = f", {seconds.total_seconds():.2f} s after the report"
        told[worker] = f"told {how}{after} (the report said: {told[worker]})"
    return told


def _report_lines(router_stderr: str) -> dict[str, str]:
    start = router_stderr.rfind(REPORT_START)
    if start < 0:
        return {}
    told, worker = {}, ""
    for line in router_stderr[start:].splitlines():
        found = re.match(r'^worker "([^"]+)" at ', line)
        if found:
            worker = found.group(1)
        elif line.startswith("  shutdown:") and worker:
            told[worker] = line.split(":", 1)[1].strip()
        elif line.startswith("exit code "):
            break
    return told


def _figure(runs: list[FailRun]) -> Any:
    fig, (ax,) = new_figure(1, width=7.0, height=3.5)
    labels = [f"{r.path} #{i + 1}" for i, r in enumerate(runs)]
    y = range(len(runs))
    ax.barh(y, [r.to_router_exit_s for r in runs], color="tab:gray", label="-> router exit")
    ax.barh(y, [r.to_report_s for r in runs], color="tab:blue", label="-> router report (all told)")
    ax.axvline(GOAL_S, color="tab:red", linestyle="--", label=f"goal {GOAL_S:g} s")
    ax.set_yticks(list(y), labels)
    median = statistics.median(r.to_report_s for r in runs)
    ax.set_xlabel(f"seconds after the refused worker's report (median report {median:.2f} s)")
    ax.set_title("fail-fast under --paged-attn on")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
