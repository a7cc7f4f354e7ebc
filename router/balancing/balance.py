"""The one interface every balance implements, and how a router picks one (--balance).

A balance sees the request's model's serving workers (never empty) and the request, and returns one of
them (a balance that needs no more than the load does not look at the request). Balances are pure: no
I/O, no clock; what they read (outstanding requests, free blocks from heartbeats) is in the registry
entries. A new balance is a new file here plus a line in
BALANCES (router/balancing/__init__.py), not an `if` in the router.
"""

from __future__ import annotations

from typing import Protocol

from kvpact.router.registry import WorkerEntry
from kvpact.v1 import generation_pb2


class Balance(Protocol):
    name: str

    def choose(self, candidates: list[WorkerEntry], request: generation_pb2.GenerateRequest) -> WorkerEntry:
        """`candidates`: the model's serving workers (non-empty)."""
        ...
