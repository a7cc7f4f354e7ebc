"""The operator's multi-worker case on one machine: a router and N hand-started CPU workers (the default
model, paged, no thread flags), then 6 requests of 48 tokens (ignore_eos, greedy) sent at once.

    python -m benchmarks.shared_machine 1     # one worker alone
    python -m benchmarks.shared_machine 2     # two workers sharing the machine
    GOMP_SPINCOUNT=300000 python -m benchmarks.shared_machine 2   # OpenMP's default spin, for comparison
    python -m benchmarks.shared_machine 2 --sigterm-after 1   # SIGTERM worker w0 1 s into the load

Prints one line: workers, wall seconds (first request sent -> last token), tokens, tokens/s, and with
--sigterm-after, w0's exit code and how long its drain took (SIGTERM -> exit, against its --drain-timeout
of 30 s) and how many streams failed (its in-flight ones must finish: 0). The offline suite's "Workers
sharing this machine" table runs the same case on the suite's workload.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import threading
import time

from kvpact.client import AsyncClient
from kvpact.deploy.processes import (
    ProcessHandle,
    free_port,
    start_process,
    stop,
    wait_for_exit,
    wait_for_health,
)

REQUESTS, TOKENS = 6, 48


async def _load(address: str) -> tuple[float, int, int]:
    """(wall seconds, tokens, failed streams)."""
    async with AsyncClient(address, timeout=600) as client:

        async def one(k: int) -> int:
            tokens = 0
            prompt = f"Story number {k}: once upon a time"
            async for chunk in client.generate(prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True):
                tokens += len(chunk.token_ids)
            return tokens

        started = time.perf_counter()
        got = await asyncio.gather(*(one(k) for k in range(REQUESTS)), return_exceptions=True)
        tokens = sum(g for g in got if isinstance(g, int))
        return time.perf_counter() - started, tokens, sum(1 for g in got if isinstance(g, BaseException))


def _sigterm_later(handle: ProcessHandle, after_s: float, drained: dict[str, float]) -> None:
    time.sleep(after_s)
    sent = time.perf_counter()
    handle.popen.send_signal(signal.SIGTERM)
    drained["code"] = wait_for_exit(handle, 60)
    drained["seconds"] = time.perf_counter() - sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workers", type=int, nargs="?", default=2)
    parser.add_argument("--sigterm-after", type=float, default=None, metavar="S")
    args = parser.parse_args(argv)
    num_workers = args.workers
    address = f"127.0.0.1:{free_port()}"
    logs = tempfile.mkdtemp(prefix="kvpact-shared-")
    quiet = ["--log-format", "json", "--log-level", "WARNING"]
    router = [sys.executable, "-m", "kvpact.router", "--listen", address]
    router += ["--expect-workers", str(num_workers)]
    handles = [start_process([*router, *quiet], name="router", log_dir=logs, die_with_parent=True)]
    for n in range(num_workers):
        worker = [sys.executable, "-m", "kvpact.worker", "--router", address, "--device", "cpu"]
        worker += ["--paged-attn", "on", "--worker-id", f"w{n}", *quiet]
        handles.append(start_process(worker, name=f"w{n}", log_dir=logs, die_with_parent=True))
    try:
        wait_for_health(address, 300, watch=handles)
        drained: dict[str, float] = {}
        if args.sigterm_after is not None:
            killer = threading.Thread(target=_sigterm_later, args=(handles[1], args.sigterm_after, drained))
            killer.start()
        wall, tokens, failed = asyncio.run(_load(address))
        line = f"workers={num_workers} wall={wall:.1f}s tokens={tokens} tok/s={tokens / wall:.1f}"
        if args.sigterm_after is not None:
            killer.join(90)
            line += (
                f" w0_exit={drained.get('code')} w0_drain={drained.get('seconds', -1):.1f}s failed={failed}"
            )
        print(line)
    finally:
        for handle in reversed(handles):
            stop(handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
