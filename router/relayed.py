"""A worker's GenerateChunk as the router relays it: the bytes the worker sent, and their parse.

NOTE: the router reads each chunk (token count for metrics, index and sizes for coalescing, the fields
Complete and the HTTP front render) but never re-encodes one it did not change: the gRPC front writes
`data`, the worker's own bytes, to the client (the Generate method's response serializer is
`relayed_bytes`, router/server.py). Invariant: `message` is always the parse of `data`. A change (the
router's `worker_id` when a worker sent none; several chunks merged into one) builds a new
RelayedChunk. Appending a serialized field is how the one change is made without re-encoding:
protobuf reads concatenated messages as one, the last value of a scalar field winning.
"""

from __future__ import annotations

from typing import Any

from kvpact.v1 import generation_pb2


class RelayedChunk:
    __slots__ = ("data", "message")

    def __init__(self, data: bytes, message: generation_pb2.GenerateChunk) -> None:
        self.data = data
        self.message = message

    @classmethod
    def of(cls, message: generation_pb2.GenerateChunk) -> RelayedChunk:
        """A chunk the router built itself (a merge): encoded once here."""
        return cls(message.SerializeToString(), message)

    def __getattr__(self, name: str) -> Any:
        """The message's fields read through (chunk.token_ids), for code that takes either kind."""
        if name in RelayedChunk.__slots__ or name.startswith("__"):  # unset slot, copy/pickle probes
            raise AttributeError(name)
        return getattr(self.message, name)


def fill_worker_id(data: bytes, message: generation_pb2.GenerateChunk, worker_id: str) -> bytes:
    """`data` (the bytes of `message`, which has no worker id) with `worker_id` appended, and set in
    `message` too."""
    message.worker_id = worker_id
    return data + generation_pb2.GenerateChunk(worker_id=worker_id).SerializeToString()


def relayed_bytes(chunk: RelayedChunk) -> bytes:
    """The response serializer of the router's Generate: what the worker sent, as it sent it."""
    return chunk.data
