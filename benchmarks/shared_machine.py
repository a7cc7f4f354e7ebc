"""The operator's multi-worker case on one machine: a router and N hand-started CPU workers (the default
model, paged, no thread flags), then 6 requests of 48 tokens (ignore_eos, greedy) sent at once.

    python -m benchmarks.shared_machine 1     # one worker alone
    python -m benchmarks.shared_machine 2     # two workers sharing the machine
    GOMP_SPINCOUNT=300000 python -m benchmarks.shared_machine 2   # OpenMP's default spin, for comparison

Prints one line: workers, wall seconds (first request sent -> last token), tokens, tokens/s. The offline
suite's "Workers sharing this machine" table runs the same case on the suite's workload.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

from kvpact.client import AsyncClient
from kvpact.deploy.processes import free_port, start_process, stop, wait_for_health

REQUESTS, TOKENS = 6, 48


async def _load(address: str) -> tuple[float, int]:
    async with AsyncClient(address, timeout=600) as client:

        async def one(k: int) -> int:
            tokens = 0
            prompt = f"Story number {k}: once upon a time"
            async for chunk in client.generate(prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True):
                tokens += len(chunk.token_ids)
            return tokens

        started = time.perf_counter()
        got = await asyncio.gather(*(one(k) for k in range(REQUESTS)))
        return time.perf_counter() - started, sum(got)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workers", type=int, nargs="?", default=2)
    num_workers = parser.parse_args(argv).workers
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
        wall, tokens = asyncio.run(_load(address))
        print(f"workers={num_workers} wall={wall:.1f}s tokens={tokens} tok/s={tokens / wall:.1f}")
    finally:
        for handle in reversed(handles):
            stop(handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
