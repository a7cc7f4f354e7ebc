"""Where gRPC does a connection's reads and writes, chosen before grpc loads (the router's and the worker's
entry points).

grpcio (1.85, constraints.txt) runs them by default on its EventEngine's own threads (named event_engine,
four of them), from which every completion reaches grpc.aio's poller thread and then the event loop. With
its EventEngine client and listener experiments off, they run in the polling the poller thread already
does, and the pool's threads go idle. Measured on the 2-core machine, served one sequence a step
(`python -m benchmarks.served_rounds --max-num-seqs 1 --requests 8`, against the same with
`GRPC_EXPERIMENTS=` for gRPC's defaults): the router's CPU per token 0.58-0.61 ms against 0.78-0.79;
at 256 streams (`python -m benchmarks.router_ab`) within that host's noise. docs/performance.md "gRPC's
I/O on its poller thread".

gRPC reads GRPC_EXPERIMENTS once, when it loads, so this must run before anything imports grpc (set
later, it changes nothing). An operator's own GRPC_EXPERIMENTS wins.
"""

from __future__ import annotations

from collections.abc import MutableMapping

EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def set_grpc_io(env: MutableMapping[str, str]) -> None:
    if "GRPC_EXPERIMENTS" not in env:
        env["GRPC_EXPERIMENTS"] = EXPERIMENTS
