"""The router suite's synthetic worker, engine-steps load (benchmarks/synthetic_worker.py): a stream whose
writes fell behind gets the tokens that piled up as one message, as from a real worker, and every token
still once, in order, the finish and usage on the last message only."""

from __future__ import annotations

import asyncio

from benchmarks.synthetic_worker import EngineSteps, SyntheticWorker
from kvpact.v1 import generation_pb2
from tests.factories.eventually import eventually_async

N = 40


def test_engine_steps_merge_what_piled_up_behind_a_slow_write():
    async def main() -> list[generation_pb2.GenerateChunk]:
        steps = EngineSteps(asyncio.get_running_loop(), step_s=0.002)
        steps.thread.start()
        worker = SyntheticWorker("synthetic-0", tokens_per_s=0.0, steps=steps)
        request = generation_pb2.GenerateRequest(request_id="r", text="x", max_tokens=N)
        chunks: list[generation_pb2.GenerateChunk] = []
        try:
            async for chunk in worker.Generate(request, None):
                chunks.append(chunk)
                if len(chunks) == 1:  # this "write" is slow: the steps go on without it
                    [stream] = steps.streams.values()
                    # on this loop, not just stepped: the step thread counts a token before it hands it over
                    await eventually_async(lambda s=stream: s.pieces.num_queued() >= 9, what="9 queued")
        finally:
            steps.stopped.set()
            steps.thread.join(timeout=5)
        assert worker.num_running == 0 and not steps.streams  # the stream left the step loop
        return chunks

    chunks = asyncio.run(main())
    assert chunks[0].token_ids  # what had queued when the loop first looked: [1] unless it was late
    assert len(chunks[1].token_ids) >= 9  # the ones that piled up behind it: one message
    assert [t for c in chunks for t in c.token_ids] == list(range(1, N + 1))  # each once, in order
    assert sum(c.text.count(";") for c in chunks) == N  # one send-time stamp per token
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.completion_tokens == N and {c.worker_id for c in chunks} == {"synthetic-0"}
