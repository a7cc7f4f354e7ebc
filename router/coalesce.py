"""Merging a relayed stream's chunks when its client falls behind: the chunks that are ready together go
out as one message.

The router reads every worker's chunks as they come, on its one Worker.Stream call to that worker
(router/worker_stream.py), into each request's inbox. Each time a request's relay is free to write,
`ready_chunks` takes whatever its inbox holds:

- a relay whose client keeps up finds one chunk each time and sends it as it came; the first token,
  and every token of a stream that keeps up, goes out at once, never held back to wait for a second;
- a relay that was busy writing (a slow client, a slow network, HTTP/2 flow control holding the
  router's writes) finds several and sends them as one message: token ids, logprobs and top_logprobs
  concatenated, the text deltas joined, finish_reason and usage from the last one (only the last chunk
  of a stream has them); chunks of different completions (`index`, n > 1) are never merged;
- nothing is reordered, dropped or sent twice; a merged message never spans more than
  MAX_TOKENS_PER_MESSAGE tokens or MAX_TEXT_PER_MESSAGE characters of text (a long backlog goes out
  as several messages, still in order);
- the request's end (the worker's status) is read by the relay after every chunk before it.

The chunks are RelayedChunks (router/relayed.py: the worker's bytes with their parse): the gRPC front
writes the worker's bytes as they came; a merge is encoded once. Chunk boundaries are not part of the
contract: a client that needs per-token timing reads the token ids.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from kvpact.router.relayed import RelayedChunk, fill_worker_id
from kvpact.router.worker_stream import Inbox
from kvpact.shared.limits import MAX_TOKENS_PER_MESSAGE
from kvpact.v1 import generation_pb2

MAX_TEXT_PER_MESSAGE = 64 * 1024  # characters; far below the gRPC message cap (shared/limits.py)
parse_chunk = generation_pb2.GenerateChunk.FromString


def merge_chunks(chunks: list[RelayedChunk]) -> RelayedChunk:
    """One chunk carrying `chunks` (consecutive, of one stream and one index) in order; one chunk as it
    is, several encoded once."""
    if len(chunks) == 1:
        return chunks[0]
    merged = generation_pb2.GenerateChunk()
    for chunk in chunks:
        merged.MergeFrom(chunk.message)  # repeated fields concatenate; set scalars/messages: the last wins
    merged.text = "".join(chunk.message.text for chunk in chunks)
    return RelayedChunk.of(merged)


def take_batch(ready: list[RelayedChunk]) -> list[RelayedChunk]:
    """Remove and return the longest prefix of `ready` that fits one message and continues one
    completion (at least one chunk)."""
    num_tokens = num_chars = 0
    end = 0
    index = ready[0].message.index
    for chunk in ready:
        message = chunk.message
        num_tokens += len(message.token_ids)
        num_chars += len(message.text)
        too_big = num_tokens > MAX_TOKENS_PER_MESSAGE or num_chars > MAX_TEXT_PER_MESSAGE
        if end and (too_big or message.index != index):
            break
        end += 1
    batch = ready[:end]
    del ready[:end]
    return batch


async def ready_chunks(inbox: Inbox, worker_id: str) -> AsyncGenerator[RelayedChunk, None]:
    """`inbox`'s chunks (from worker `worker_id`, its id filled in where the worker left it empty), the
    ones ready together merged (see the module docstring), until its end; the caller reads the end."""
    ready: list[RelayedChunk] = []
    while True:
        for data in inbox.take():
            message = parse_chunk(data)  # inline: this runs once per message (a classmethod cost ~1 us more)
            if not message.worker_id:
                data = fill_worker_id(data, message, worker_id)
            ready.append(RelayedChunk(data, message))
        if len(ready) == 1:  # a relay that keeps up: the chunk as it came
            yield ready.pop()
        elif ready:
            yield merge_chunks(take_batch(ready))
        elif inbox.end is not None:
            return
        else:
            await inbox.wait()
