"""The chunks of one HTTP request's GenerateRequests, as (choice index, chunk), from the router's own relay.

The HTTP front calls the same `GenerationService.relay` as the gRPC front (routing, retries, limits,
overload bounds, metrics with api="http"), merged the same way (router/coalesce.py); it renders
each chunk's parse (RelayedChunk.message) as JSON, so the worker's bytes are not relayed here. One request
(a chat, a single prompt) is read in the caller's task, so an SSE client that goes away cancels the
worker call directly. Several prompts (completions with a list of prompts) are read concurrently, one
task each, into one bounded queue; the first error ends them all. Closing the generator cancels every
worker call and waits for it, so the workers' KV blocks are being freed when `aclose()` returns.

Choice index = prompt index * n + GenerateChunk.index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from kvpact.router.service import GenerationService
from kvpact.v1 import generation_pb2

API = "http"
MAX_QUEUED = 1024  # chunks read ahead of the SSE writer, over all prompts of one request

Item = tuple[int, generation_pb2.GenerateChunk]


async def choice_chunks(
    service: GenerationService, requests: list[generation_pb2.GenerateRequest], n: int
) -> AsyncGenerator[Item, None]:
    if len(requests) == 1:
        async with aclosing(service.relay(requests[0], None, API)) as chunks:
            async for chunk in chunks:
                yield chunk.message.index, chunk.message
        return
    queue: asyncio.Queue[Item | BaseException | None] = asyncio.Queue(MAX_QUEUED)

    async def pump(prompt_index: int, request: generation_pb2.GenerateRequest) -> None:
        try:
            async with aclosing(service.relay(request, None, API)) as chunks:
                async for chunk in chunks:
                    await queue.put((prompt_index * n + chunk.message.index, chunk.message))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, raised there
            await queue.put(exc)
            return
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, request)) for i, request in enumerate(requests)]
    try:
        num_done = 0
        while num_done < len(tasks):
            item = await queue.get()
            if item is None:
                num_done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
