"""What rank 0 tells the other ranks each step, over torch.distributed (gloo): enough for each rank to run
the same forward on its own shard and its own KV cache. Rank 0 alone schedules and samples.

    StepMessage   the flat batch's token ids and, per chunk, (slot, start, num_tokens); num_decodes first;
                  with a paged cache also each chunk's block ids (rank 0's one block table drives every
                  rank's pool) and the step's copy-on-write block copies
    None          stop (the worker is closing)
    KEEPALIVE     nothing to run: sent when idle, so no rank's collective times out
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

KEEPALIVE = "keepalive"


@dataclass(frozen=True, slots=True)
class StepMessage:
    input_ids: list[int]
    chunks: list[tuple[int, int, int]]  # (slot, start, num_tokens), in the runner's flat order
    num_decodes: int
    block_tables: list[list[int]] | None = None  # paged: each chunk's block ids, in chunk order
    block_copies: list[tuple[int, int]] | None = None  # paged: (src, dst), copied before the step

    def positions(self) -> list[int]:
        return [p for _, start, n in self.chunks for p in range(start, start + n)]

    def chunk_views(self) -> list[ChunkView]:
        tables = self.block_tables or [[] for _ in self.chunks]
        return [
            ChunkView(SlotView(slot, BlockIds(ids)), start, start + n)
            for (slot, start, n), ids in zip(self.chunks, tables, strict=True)
        ]


@dataclass(frozen=True, slots=True)
class BlockIds:
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class SlotView:
    """What the caches read of a Sequence: its eager slot, its paged block table."""

    slot: int
    block_table: BlockIds
    request_id: str = "(rank 0's)"


@dataclass(frozen=True, slots=True)
class ChunkView:
    """What the caches read of a ScheduledChunk (`seq.slot`, `start`, `end`, `num_tokens`)."""

    seq: SlotView
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def send(message: StepMessage | str | None) -> None:
    dist.broadcast_object_list([message], src=0)


def receive() -> StepMessage | str | None:
    box: list[object] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def broadcast(obj: object = None) -> object:
    """Before the steps: rank 0's `obj` (the spec, then the build), the same on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: object) -> list[object] | None:
    """Before the steps: every rank's `obj` (its verdict, then its build's outcome), on rank 0 in rank
    order (None on the other ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: list[object] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
