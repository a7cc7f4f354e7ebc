"""Coalescing a relayed Generate stream: when the client's side falls behind, the chunks that are ready
go out as one message.

The worker sends one GenerateChunk per decode step. While the client keeps up, the relay reads one
chunk and writes it, in one task, as it came (nothing between the worker's message and the client's).
A write that takes longer than BEHIND_AFTER_S means the client's side fell behind (a slow client, a
slow network, HTTP/2 flow control holding the router's writes): from then on the router reads the
worker's chunks in a task of their own, and the writer takes whatever has arrived each time it is free:

- the first token, and every token of a stream that keeps up, goes out as it came (a writer that is
  waiting gets a chunk at once, never held back to wait for a second);
- a writer that was busy finds several chunks ready and sends them as one message: token ids,
  logprobs and top_logprobs concatenated, the text deltas joined, finish_reason and usage from the
  last one (only the last chunk of a stream has them); chunks of different completions (`index`,
  n > 1) are never merged;
- nothing is reordered, dropped or sent twice; a merged message never spans more than
  MAX_TOKENS_PER_MESSAGE tokens or MAX_TEXT_PER_MESSAGE characters of text (a long backlog goes out
  as several messages, still in order);
- the reader stops reading while MAX_READY chunks wait for the writer, so a stuck client still
  pushes back on the worker (HTTP/2 flow control) instead of piling its stream up in the router;
- the source's error (a worker's status, a cancelled call) reaches the client after every chunk that
  was read before it, so the stream's final status is what it was without coalescing.

Why not read ahead always: measured at 256 full-speed streams (docs/performance.md, "Router"), a relay
that always reads in a second task merged nothing (the router's reads, not its writes, are the slow
side when it is busy) and spent about a quarter more CPU per token on the extra task switch.

The chunks are GenerateChunks, or RelayedChunks (router/relayed.py: the worker's bytes with their parse)
on the gRPC front, which writes the worker's bytes as they came; a merge there is encoded once.

Chunk boundaries are not part of the contract: a client that needs per-token timing reads the token
ids. Closing the coalesced stream (the client went away) closes the source, and cancels and waits for
the reader, so the worker call is over when `aclose()` returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

from kvpact.router.relayed import RelayedChunk
from kvpact.v1 import generation_pb2

MAX_TOKENS_PER_MESSAGE = 1024
MAX_TEXT_PER_MESSAGE = 64 * 1024  # characters; far below the gRPC message cap (shared/limits.py)
MAX_READY = 4 * MAX_TOKENS_PER_MESSAGE  # chunks read ahead of the writer before the reader waits
BEHIND_AFTER_S = 0.05  # a write that took longer: the client's side is behind; read ahead from then on

Chunk = TypeVar("Chunk", generation_pb2.GenerateChunk, RelayedChunk)


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """One chunk carrying `chunks` (consecutive, of one stream and one index) in order."""
    if len(chunks) == 1:
        return chunks[0]
    if isinstance(chunks[0], RelayedChunk):
        return RelayedChunk.of(_merged([chunk.message for chunk in chunks]))
    return _merged(chunks)


def _merged(chunks: list[generation_pb2.GenerateChunk]) -> generation_pb2.GenerateChunk:
    merged = generation_pb2.GenerateChunk()
    for chunk in chunks:
        merged.MergeFrom(chunk)  # repeated fields concatenate; set scalars/messages: the last one wins
    merged.text = "".join(chunk.text for chunk in chunks)
    return merged


def take_batch(ready: list[Chunk]) -> list[Chunk]:
    """Remove and return the longest prefix of `ready` that fits one message and continues one
    completion (at least one chunk)."""
    num_tokens = num_chars = 0
    end = 0
    for chunk in ready:
        num_tokens += len(chunk.token_ids)
        num_chars += len(chunk.text)
        too_big = num_tokens > MAX_TOKENS_PER_MESSAGE or num_chars > MAX_TEXT_PER_MESSAGE
        if end and (too_big or chunk.index != ready[0].index):
            break
        end += 1
    batch = ready[:end]
    del ready[:end]
    return batch


class _Reader(Generic[Chunk]):
    """Reads `source` into `ready` until it ends; wakes the writer when something arrives, and waits for
    the writer while MAX_READY chunks are ready."""

    def __init__(self, source: AsyncIterator[Chunk]) -> None:
        self.source: AsyncIterator[Chunk] = source
        self.ready: list[Chunk] = []
        self.done = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None  # the writer, waiting for a chunk
        self._space: asyncio.Future[None] | None = None  # this reader, waiting for the writer

    async def run(self) -> None:
        try:
            async for chunk in self.source:
                self.ready.append(chunk)
                self._wake()
                if len(self.ready) >= MAX_READY:
                    self._space = asyncio.get_running_loop().create_future()
                    try:
                        await self._space
                    finally:
                        self._space = None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the writer, raised there in order
            self.error = exc
        finally:
            self.done = True
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[Chunk]:
        batch = take_batch(self.ready)
        space = self._space
        if space is not None and not space.done():
            space.set_result(None)
        return batch

    async def wait(self) -> None:
        """Until a chunk is ready or the source ended."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


async def coalesced(
    source: AsyncGenerator[Chunk, None],
    behind_after_s: float = BEHIND_AFTER_S,
) -> AsyncGenerator[Chunk, None]:
    """`source`'s chunks; once a write took longer than `behind_after_s`, the ones ready together are
    merged into one (see the module docstring)."""
    clock = asyncio.get_running_loop().time
    task: asyncio.Task[None] | None = None
    try:
        async for chunk in source:  # the client keeps up: one read, one write
            started = clock()
            yield chunk
            if clock() - started > behind_after_s:
                break
        else:
            return
        reader = _Reader(source)  # the client fell behind: read ahead, merge what is ready
        task = asyncio.get_running_loop().create_task(reader.run())
        while True:
            if not reader.ready:
                if reader.done:
                    break
                await reader.wait()
                continue
            yield merge_chunks(reader.take())
        if reader.error is not None:
            raise reader.error
    finally:
        try:
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        finally:
            await source.aclose()
