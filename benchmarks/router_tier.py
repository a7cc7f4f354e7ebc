"""Processes for the router suite: routers with synthetic (or real) workers behind them, load-generating
clients in processes of their own, and the CPU time each process spent while the load was counted.

Every process binds 127.0.0.1 on a port it chose itself, every wait is bounded, and everything is
stopped by pid on the way out (kvpact.deploy.processes).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpact.deploy.processes import (
    ProcessHandle,
    running,
    start_process,
    stop,
    wait_for_health,
    wait_for_line,
)

START_TIMEOUT_S = 60.0
MODEL_START_TIMEOUT_S = 240.0
LOAD_GRACE_S = 300.0  # a load client's own start and end beyond its --warmup + --seconds
_ADDRESS = r"listening on (\S+:\d+)"


@dataclass(slots=True)
class Tier:
    """Routers (their client-facing addresses) and the workers registered with them, router i's
    workers being `workers_of[i]`."""

    router_addresses: list[str]
    worker_addresses: list[str]
    pids: dict[str, int] = field(default_factory=dict)  # process name -> pid
    http_addresses: list[str] = field(default_factory=list)  # their OpenAI fronts (http=True)

    @property
    def router_target(self) -> str:
        return ",".join(self.router_addresses)


def router_argv(*, num_workers: int, event_loop: str = "", http: bool = False) -> list[str]:
    argv = [sys.executable, "-m", "kvpact.router", "--listen", "127.0.0.1:0"]
    argv += ["--http-listen", "127.0.0.1:0"] if http else []
    argv += ["--expect-workers", str(num_workers), "--log-format", "json", "--log-level", "WARNING"]
    if event_loop:
        argv += ["--event-loop", event_loop]
    return argv


def _start_router(
    stack: ExitStack,
    tier: Tier,
    name: str,
    log_dir: Path,
    *,
    num_workers: int,
    event_loop: str,
    http: bool = False,
) -> str:
    argv = router_argv(num_workers=num_workers, event_loop=event_loop, http=http)
    handle = stack.enter_context(running(argv, name=name, log_dir=log_dir))
    address = wait_for_line(handle, r"^router " + _ADDRESS, START_TIMEOUT_S).group(1)
    if http:
        tier.http_addresses.append(
            wait_for_line(handle, r"^router http " + _ADDRESS, START_TIMEOUT_S).group(1)
        )
    tier.pids[name] = handle.pid
    tier.router_addresses.append(address)
    return address


@contextmanager
def synthetic_tier(
    log_dir: Path,
    *,
    num_routers: int = 1,
    tokens_per_s: float = 0.0,
    step_ms: float = 0.0,
    event_loop: str = "",
    http: bool = False,
) -> Iterator[Tier]:
    """`num_routers` router processes, each with one synthetic worker registered (router-i, worker-i);
    with `http`, each router also serves its OpenAI-compatible front (Tier.http_addresses). The workers
    stream per token at `tokens_per_s` (0: full speed), or with `step_ms` in engine steps of that length
    (benchmarks/synthetic_worker.py)."""
    tier = Tier([], [])
    with ExitStack() as stack:
        handles: list[ProcessHandle] = []
        for i in range(num_routers):
            address = _start_router(
                stack, tier, f"router-{i}", log_dir, num_workers=1, event_loop=event_loop, http=http
            )
            argv = [sys.executable, "-m", "benchmarks.synthetic_worker", "--router", address]
            argv += ["--worker-id", f"synthetic-{i}", "--tokens-per-s", f"{tokens_per_s:g}"]
            argv += ["--step-ms", f"{step_ms:g}"] if step_ms else []
            worker = stack.enter_context(running(argv, name=f"worker-{i}", log_dir=log_dir))
            handles.append(worker)
            tier.worker_addresses.append(
                wait_for_line(worker, r"^synthetic worker " + _ADDRESS, START_TIMEOUT_S).group(1)
            )
            tier.pids[f"worker-{i}"] = worker.pid
        for address in tier.router_addresses:
            wait_for_health(address, START_TIMEOUT_S, watch=handles)
        yield tier


@contextmanager
def model_tier(log_dir: Path, model: Path, extra_worker_flags: Sequence[str] = ()) -> Iterator[Tier]:
    """One router and one real worker serving `model` (eager cache, the CPU default)."""
    tier = Tier([], [])
    with ExitStack() as stack:
        address = _start_router(stack, tier, "router-0", log_dir, num_workers=1, event_loop="")
        argv = [sys.executable, "-m", "kvpact.worker", "--router", address, "--worker-id", "model-0"]
        argv += ["--model", str(model), "--listen", "127.0.0.1:0", "--log-format", "json"]
        argv += ["--log-level", "WARNING", *extra_worker_flags]
        worker = stack.enter_context(running(argv, name="worker-0", log_dir=log_dir))
        wait_for_health(address, MODEL_START_TIMEOUT_S, watch=[worker])
        tier.worker_addresses.append(wait_for_line(worker, _ADDRESS, START_TIMEOUT_S).group(1))
        tier.pids["worker-0"] = worker.pid
        yield tier


def _stat_cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each live thread of process `pid` so far, by thread id."""
    result = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            result[int(task.name)] = _stat_cpu_seconds(task / "stat")
        except OSError:  # the thread ended meanwhile
            pass
    return result


@dataclass(slots=True)
class LoadResult:
    """What the clients saw while the load was counted, and each watched process's CPU seconds then."""

    num_tokens: int
    num_messages: int
    seconds: float
    latency_p50_ms: float
    latency_p99_ms: float
    first_token_p50_ms: float
    cpu_s: dict[str, float]
    latencies_ms: list[float] = field(default_factory=list)
    tokens_by_worker: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def messages_per_token(self) -> float:
        return self.num_messages / max(self.num_tokens, 1)

    def tokens_per_cpu_s(self, name: str) -> float:
        """Tokens per CPU second of process `name`: what it relays with a core of its own."""
        cpu = self.cpu_s.get(name, 0.0)
        return self.num_tokens / cpu if cpu > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "num_tokens": self.num_tokens,
            "num_messages": self.num_messages,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "latency_p50_ms": self.latency_p50_ms,
            "latency_p99_ms": self.latency_p99_ms,
            "first_token_p50_ms": self.first_token_p50_ms,
            "cpu_s": {k: round(v, 3) for k, v in self.cpu_s.items()},
            "tokens_by_worker": self.tokens_by_worker,
        }


def run_load(
    target: str,
    service: str,
    log_dir: Path,
    *,
    streams: int,
    seconds: float,
    tokens_per_s: float = 0.0,
    max_tokens: int = 256,
    prompt_text: str = "",
    warmup: float = 1.0,
    latency: bool = False,
    num_clients: int = 1,
    requests: int = 0,
    watch: dict[str, int] | None = None,
    http_client: str = "",
    stagger: float = 0.02,
) -> LoadResult:
    """`streams` streams against `target` from `num_clients` client processes, their first requests
    spread over `stagger` seconds; the processes in `watch` (name -> pid) have their CPU time sampled
    over the counted window."""
    watch = watch or {}
    per_client = [streams // num_clients + (i < streams % num_clients) for i in range(num_clients)]
    handles = []
    try:
        for i, n in enumerate(per_client):
            argv = [sys.executable, "-m", "benchmarks.stream_load", "--target", target, "--service", service]
            argv += [
                "--streams",
                str(n),
                "--tokens-per-s",
                f"{tokens_per_s:g}",
                "--max-tokens",
                str(max_tokens),
            ]
            argv += ["--seconds", f"{seconds:g}", "--warmup", f"{warmup:g}", "--requests", str(requests)]
            argv += ["--stagger", f"{stagger:g}"]
            argv += ["--prompt-text", prompt_text] if prompt_text else []
            argv += ["--http-client", http_client] if http_client else []
            argv += ["--latency", "--keep-latencies"] if latency else []
            handles.append(start_process(argv, name=f"load-{service}-{i}", log_dir=log_dir))
        time.sleep(warmup + 0.3)  # the clients start (imports) and warm up
        before = {name: cpu_seconds(pid) for name, pid in watch.items()}
        time.sleep(seconds)
        after = {name: cpu_seconds(pid) for name, pid in watch.items()}
        results = []
        for handle in handles:
            handle.popen.wait(timeout=warmup + seconds + LOAD_GRACE_S)
            lines = [line for line in handle.stdout().splitlines() if line.startswith("{")]
            if handle.returncode != 0 or not lines:
                raise RuntimeError(f"load client failed (exit {handle.returncode})\n{handle.output()}")
            results.append(json.loads(lines[-1]))
    finally:
        for handle in handles:
            stop(handle, grace_s=5)
    latencies = [x for r in results for x in r["latency_ms"]]
    by_worker: dict[str, int] = {}
    for r in results:
        for worker_id, n in r["tokens_by_worker"].items():
            by_worker[worker_id] = by_worker.get(worker_id, 0) + n
    return LoadResult(
        num_tokens=sum(r["num_tokens"] for r in results),
        num_messages=sum(r["num_messages"] for r in results),
        seconds=max(r["seconds"] for r in results),
        latency_p50_ms=percentile(latencies, 50),
        latency_p99_ms=percentile(latencies, 99),
        first_token_p50_ms=percentile([r["first_token_p50_ms"] for r in results], 50),
        cpu_s={name: after[name] - before[name] for name in watch},
        latencies_ms=latencies,
        tokens_by_worker=by_worker,
    )


def percentile(values: list[float], q: float) -> float:
    values = [v for v in values if v == v]
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def router_log_errors(log_dir: Path) -> list[str]:
    """Error lines the routers logged (a relay that failed shows up here)."""
    lines = []
    for path in sorted(log_dir.glob("router-*.stderr")):
        lines += [line for line in path.read_text().splitlines() if re.search(r'"level": "error"', line)]
    return lines
