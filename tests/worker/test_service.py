"""The Worker gRPC service of a real standalone worker process on a tiny model, over loopback."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpact.v1 import generation_pb2, worker_pb2, worker_pb2_grpc
from kvpact.worker.cli import parse_args
from kvpact.worker.engine.request import GenerationError, GenerationRequest, SamplingParams
from kvpact.worker.service import WorkerServer, WorkerService
from kvpact.worker.startup.engine_setup import build_engine
from tests.factories.eventually import eventually
from tests.factories.processes import started_worker, stop
from tests.factories.tiny_models import make_tiny_llama

# Paged on CPU (torch backend), so the worker has blocks whose return we can check.
MAX_MODEL_LEN = 4096
FLAGS = ("--paged-attn", "on", "--max-model-len", str(MAX_MODEL_LEN))
LONG = 4000  # tokens: a generation (seconds on the tiny model) that outlasts the cancel/deadline points below


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def worker(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--worker-id", "w-standalone", *FLAGS]
    with started_worker(args, log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running
        assert stop(running.handle, sig=signal.SIGTERM) == 0, running.handle.output()


@pytest.fixture
def stub(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def greedy(text: str, max_tokens: int, **fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("sampling", generation_pb2.SamplingParams(temperature=0.0))
    return generation_pb2.GenerateRequest(text=text, max_tokens=max_tokens, **fields)


def all_blocks_free(stub) -> worker_pb2.WorkerLoad | None:
    load = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
    done = load.num_running == 0 and load.num_waiting == 0 and load.num_free_blocks == load.num_total_blocks
    return load if done else None


def test_health_is_serving_and_reflection_lists_the_services(worker):
    with grpc.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvpact.v1.Worker"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for s in next(iter(replies)).list_services_response.service}
    assert {"kvpact.v1.Worker", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_stream_matches_the_engine_run_in_process(stub, model_dir):
    prompts = ["Hello, world!", "The quick brown fox", "日本語 🙂"]
    spec = parse_args(["--model", str(model_dir), *FLAGS]).spec
    with build_engine(spec) as engine:
        expected = engine.run(
            [
                GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=12, ignore_eos=True)
                for i, p in enumerate(prompts)
            ],
            timeout=60,
        )
    for prompt, want in zip(prompts, expected, strict=True):
        chunks = list(
            stub.Generate(greedy(prompt, 12, ignore_eos=True, request_id=f"id-{prompt}"), timeout=60)
        )
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        assert {c.request_id for c in chunks} == {f"id-{prompt}"}
        assert {c.worker_id for c in chunks} == {"w-standalone"}
        last = chunks[-1]
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            want.usage.prompt_tokens,
            want.usage.completion_tokens,
        )
        assert all(c.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (generation_pb2.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty"),
        (generation_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt"),
        (greedy("hi", 0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1, got 0"),
        (
            generation_pb2.GenerateRequest(text="hi", sampling=generation_pb2.SamplingParams(top_p=1.5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p must be in (0, 1], got 1.5",
        ),
        (
            greedy("hi", MAX_MODEL_LEN),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"more than max_model_len {MAX_MODEL_LEN}",
        ),
        (greedy("hi", 4, model="other"), grpc.StatusCode.NOT_FOUND, "model 'other' is not served here"),
        (
            greedy("hi", 4, response_format=generation_pb2.ResponseFormat(json_schema='{"type": 5}')),
            grpc.StatusCode.INVALID_ARGUMENT,
            "response_format.json_schema is not a JSON Schema this worker can enforce",
        ),
        (
            greedy("hi", 4, sampling=generation_pb2.SamplingParams(top_logprobs=3)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_logprobs (3) needs logprobs",
        ),
        (greedy("hi", 4, n=17), grpc.StatusCode.INVALID_ARGUMENT, "n is 17, more than the cap of 16"),
        (
            greedy("hi", 4, min_tokens=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            "min_tokens (5) must be <= max_tokens (4)",
        ),
    ],
)
def test_bad_requests_get_a_specific_status_and_message(stub, request_, code, message):
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(request_, timeout=30))
    assert exc.value.code() == code
    assert message in exc.value.details()
    assert "Traceback" not in exc.value.details()
    assert eventually(lambda: all_blocks_free(stub), 10, "all blocks free")


def test_cancel_mid_stream_frees_the_blocks(stub):
    total = stub.Stats(worker_pb2.StatsRequest(), timeout=5).num_total_blocks
    assert total > 0
    call = stub.Generate(greedy("Once upon a time", LONG, ignore_eos=True), timeout=60)
    next(call), next(call)
    busy = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
    assert busy.num_running == 1 and busy.num_free_blocks < total
    call.cancel()
    load = eventually(lambda: all_blocks_free(stub), 10, "the cancelled sequence's blocks to be freed")
    assert load.num_free_blocks == total


def test_n_completions_stream_with_their_index_and_a_cancel_frees_all_their_blocks(stub):
    sampling = generation_pb2.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    chunks = list(stub.Generate(greedy("Hello", 5, ignore_eos=True, n=3, sampling=sampling), timeout=60))
    assert sorted({c.index for c in chunks}) == [0, 1, 2]
    per_index = [[t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)]
    assert per_index[0] == per_index[1] == per_index[2] and len(per_index[0]) == 5  # greedy: alike
    assert all(len(c.top_logprobs) == len(c.token_ids) == len(c.tokens) for c in chunks)
    greedy_named = [
        (c.tokens[k], c.top_logprobs[k].tokens[0]) for c in chunks for k in range(len(c.token_ids))
    ]
    assert all(name == top for name, top in greedy_named)  # greedy: the token is its first alternative
    assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.completion_tokens == 15
    total = stub.Stats(worker_pb2.StatsRequest(), timeout=5).num_total_blocks
    call = stub.Generate(greedy("Once upon a time", LONG, ignore_eos=True, n=4), timeout=60)
    seen = {next(call).index for _ in range(8)}
    assert seen == {0, 1, 2, 3}
    assert stub.Stats(worker_pb2.StatsRequest(), timeout=5).num_running == 4
    call.cancel()
    load = eventually(lambda: all_blocks_free(stub), 10, "the blocks of all 4 sequences to be freed")
    assert load.num_free_blocks == total


def test_deadline_exceeded_frees_the_blocks(stub):
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(greedy("Once upon a time", LONG, ignore_eos=True), timeout=0.3))
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    eventually(lambda: all_blocks_free(stub), 10, "the timed-out sequence's blocks to be freed")


def test_abort_by_request_id_ends_the_stream_with_abort(stub):
    call = stub.Generate(greedy("Once upon a time", LONG, ignore_eos=True, request_id="to-abort"), timeout=60)
    next(call)
    assert stub.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=5).found
    rest = list(call)
    assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_ABORT
    assert not stub.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=5).found
    eventually(lambda: all_blocks_free(stub), 10, "the aborted sequence's blocks to be freed")


def test_hundreds_of_concurrent_streams_over_one_channel(worker, stub):
    num_streams = 200

    async def run() -> list[list[generation_pb2.GenerateChunk]]:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            aio_stub = worker_pb2_grpc.WorkerStub(channel)

            async def one(i: int) -> list[generation_pb2.GenerateChunk]:
                request = greedy(f"prompt {i}", 4, ignore_eos=True, request_id=f"c{i}")
                return [chunk async for chunk in aio_stub.Generate(request, timeout=120)]

            return await asyncio.gather(*(one(i) for i in range(num_streams)))

    results = asyncio.run(run())
    assert len(results) == num_streams
    for i, chunks in enumerate(results):
        assert sum(len(c.token_ids) for c in chunks) == 4, i
        assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert {c.request_id for c in chunks} == {f"c{i}"}
    eventually(lambda: all_blocks_free(stub), 10, "every block free after the burst")


def test_health_says_not_serving_until_the_engine_is_attached(model_dir):
    """In process, to hold the server between "bound" and "loaded" as long as the test needs."""
    stops: list[str] = []

    async def scenario() -> None:
        server = WorkerServer(WorkerService("w-inproc", stops.append), "127.0.0.1", 0)
        await server.start()
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            worker_stub = worker_pb2_grpc.WorkerStub(channel)
            for service in ("", "kvpact.v1.Worker"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await worker_stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "not serving (still loading" in exc.value.details()

            engine = build_engine(parse_args(["--model", str(model_dir), *FLAGS]).spec)
            try:
                server.attach(engine, "tiny")
                await server.set_ready(True)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                chunks = [c async for c in worker_stub.Generate(greedy("Hi", 3, model="tiny"), timeout=30)]
                assert sum(len(c.token_ids) for c in chunks) == 3
                await worker_stub.Shutdown(worker_pb2.ShutdownRequest(reason="test says stop"), timeout=5)
                assert stops == ["test says stop"]
            finally:
                await server.stop(1.0)
                engine.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


class BrokenEngine:
    """Stands in for an engine with a bug, to provoke an error the status table does not name."""

    def stats(self):
        raise ZeroDivisionError("a bug")

    def abort(self, request_id: str) -> bool:
        raise GenerationError("the engine failed while aborting")


def test_unexpected_errors_are_internal_without_a_stack_trace_and_the_server_keeps_serving():
    async def scenario() -> None:
        server = WorkerServer(WorkerService("w-broken", lambda reason: None), "127.0.0.1", 0)
        await server.start()
        server.attach(BrokenEngine(), "broken")  # type: ignore[arg-type]
        await server.set_ready(True)
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                for _ in range(2):  # the first failure does not take the server down
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                    assert exc.value.code() == grpc.StatusCode.INTERNAL
                    assert (
                        exc.value.details()
                        == "internal error in Stats: ZeroDivisionError (see the worker's log)"
                    )
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.Abort(worker_pb2.AbortRequest(request_id="x"), timeout=5)
                assert exc.value.code() == grpc.StatusCode.INTERNAL
                assert exc.value.details() == "the engine failed while aborting"
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 30))
