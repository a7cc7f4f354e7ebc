"""Hundreds of concurrent streams through one router to one real worker, over one router->worker
channel (a stream cap on that channel would stall the streams past it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvpact.client import AsyncClient
from tests.factories.processes import running, started_worker, wait_for_health
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import (
    START_S,
    router_address,
    router_argv,
    wait_all_blocks_free,
    worker_args,
)

NUM_STREAMS = 300


@pytest.mark.slow
def test_hundreds_of_concurrent_streams_through_the_router(tmp_path: Path):
    model = make_tiny_llama(tmp_path / "model", max_position_embeddings=2048)
    with running(router_argv("--paged-attn", "on"), name="router", log_dir=tmp_path) as router:
        address = router_address(router)
        args = worker_args(model, address, "w-load", "--paged-attn", "on", "--max-num-seqs", "256")
        with started_worker(
            args, log_dir=tmp_path, name="w-load", wait_serving=False, timeout_s=START_S
        ) as w:
            wait_for_health(address, START_S, watch=[router, w.handle])

            async def run() -> list[list[int]]:
                async with AsyncClient(address, timeout=120) as client:

                    async def one(i: int) -> list[int]:
                        stream = client.generate(
                            f"stream {i % 10}", max_tokens=8, temperature=0.0, ignore_eos=True
                        )
                        return [t async for c in stream for t in c.token_ids]

                    return await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))

            results = asyncio.run(run())
            assert all(len(r) == 8 for r in results)
            for i, r in enumerate(results):  # greedy: the same prompt gives the same tokens, batched or not
                assert r == results[i % 10]
            wait_all_blocks_free(w.address)
