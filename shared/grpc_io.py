"""Where gRPC does a connection's reads and writes, chosen before grpc loads (the router's and the worker's
entry points).

grpcio (1.85, constraints.txt) runs them by default on its EventEngine's own threads (named event_engine,
four of them), from which every completion reaches grpc.aio's poller thread and then the event loop. With
its EventEngine client and listener experiments off, they run in the polling the poller thread already
does, and the pool's threads go idle. Measured on the 2-core machine: 3,000 unary calls on loopback in one
process used 1.39 CPU-s against 1.71 (the pool's three busy threads at 0.11-0.12 each went to 0); served
one sequence a step (router + worker + client, 915 tokens), the router's CPU per token 0.51-0.56 ms
against 0.61-0.69 and a client's 0.28-0.30 against 0.38-0.42; 256 streams through one router
(`python -m benchmarks.router_ab`), docs/performance.md "gRPC's I/O on its poller thread".

gRPC reads GRPC_EXPERIMENTS once, when it loads, so this must run before anything imports grpc (set
later, it changes nothing). An operator's own GRPC_EXPERIMENTS wins.
"""

from __future__ import annotations

from collections.abc import MutableMapping

EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def set_grpc_io(env: MutableMapping[str, str]) -> None:
    if "GRPC_EXPERIMENTS" not in env:
        env["GRPC_EXPERIMENTS"] = EXPERIMENTS
