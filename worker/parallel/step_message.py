"""What rank 0 tells the other ranks each step, over torch.distributed (gloo): enough for each rank to run
the same forward on its own shard and its own KV cache. Rank 0 alone schedules and samples.

    StepMessage   the flat batch's token ids and, per chunk, (slot, start, num_tokens); num_decodes first
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

    def positions(self) -> list[int]:
        return [p for _, start, n in self.chunks for p in range(start, start + n)]

    def chunk_views(self) -> list[ChunkView]:
        return [ChunkView(SlotView(slot), start, start + n) for slot, start, n in self.chunks]


@dataclass(frozen=True, slots=True)
class SlotView:
    slot: int


@dataclass(frozen=True, slots=True)
class ChunkView:
    """What the eager cache reads of a ScheduledChunk (`seq.slot`, `start`, `end`, `num_tokens`)."""

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
