"""least-load (the default): the least outstanding work, tie-broken by more free KV blocks, then by id.

Outstanding work is the requests the router is forwarding to the worker right now (an exact and fresh
count); free blocks (EAGER: slots) are from its last heartbeat; the id makes the choice deterministic.
"""

from __future__ import annotations

from kvpact.router.registry import WorkerEntry
from kvpact.v1 import generation_pb2


def least_loaded(candidates: list[WorkerEntry]) -> WorkerEntry:
    return min(candidates, key=lambda e: (e.num_outstanding, -e.load.num_free_blocks, e.worker_id))


class LeastLoad:
    name = "least-load"

    def choose(self, candidates: list[WorkerEntry], request: generation_pb2.GenerateRequest) -> WorkerEntry:
        return least_loaded(candidates)
