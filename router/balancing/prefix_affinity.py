"""prefix-affinity: requests whose prompts start alike go to the same worker, so its prefix cache
serves the shared part; bounded by load so a hot prefix cannot overload one worker.

    key    = the prompt's first PREFIX_KEY_CHARS characters (text; chat messages as role + content in
             order, as the chat template renders them first) or first PREFIX_KEY_TOKENS token ids
             (4 blocks of 16): roughly the leading blocks a worker's prefix cache would hold
    rank   = rendezvous (highest-random-weight) hashing of (key, worker id) with blake2b: every router
             ranks the workers the same way for a key, and a worker joining or leaving moves only the
             keys it wins or held
    bound  = ceil(LOAD_FACTOR x (outstanding requests of all candidates + 1) / number of candidates)
             (consistent hashing with bounded loads, Mirrokni et al. 2018): the first worker in rank
             order whose outstanding requests stay within the bound gets the request
    no key (an empty prompt) -> least-load

The router does not tokenize, so two prompts that differ only in how they would tokenize share a key;
the key is a hint for locality, never a correctness matter.
"""

from __future__ import annotations

import hashlib
import math

from kvpact.router.balancing.least_load import least_loaded
from kvpact.router.registry import WorkerEntry
from kvpact.v1 import generation_pb2

PREFIX_KEY_CHARS = 256
PREFIX_KEY_TOKENS = 64
LOAD_FACTOR = 1.25


def routing_key(request: generation_pb2.GenerateRequest) -> bytes:
    """The request's leading prompt, as bytes (b"" for an empty prompt)."""
    which = request.WhichOneof("prompt")
    if which == "text":
        return request.text[:PREFIX_KEY_CHARS].encode()
    if which == "chat":
        rendered = "".join(f"{m.role}\x1f{m.content}\x1e" for m in request.chat.messages)
        return rendered[:PREFIX_KEY_CHARS].encode()
    if which == "token_ids":
        ids = request.token_ids.ids[:PREFIX_KEY_TOKENS]
        return b"".join(i.to_bytes(4, "little") for i in ids)
    return b""


def rank(candidates: list[WorkerEntry], key: bytes) -> list[WorkerEntry]:
    """Highest-random-weight order of the candidates for `key` (ties, which need a hash collision, by id)."""

    def weight(entry: WorkerEntry) -> bytes:
        return hashlib.blake2b(key + b"\x00" + entry.worker_id.encode(), digest_size=8).digest()

    return sorted(candidates, key=lambda e: (weight(e), e.worker_id), reverse=True)


class PrefixAffinity:
    name = "prefix-affinity"

    def choose(self, candidates: list[WorkerEntry], request: generation_pb2.GenerateRequest) -> WorkerEntry:
        key = routing_key(request)
        if not key:
            return least_loaded(candidates)
        total = sum(e.num_outstanding for e in candidates)
        bound = math.ceil(LOAD_FACTOR * (total + 1) / len(candidates))
        for entry in rank(candidates, key):
            if entry.num_outstanding + 1 <= bound:
                return entry
        return least_loaded(candidates)  # unreachable: the least loaded is always within the bound
