"""Bad input through a real router to a real worker (tiny Llama, `--paged-attn on`, 2 sequences at
once), with the real client: each gets a specific status and a message naming what was wrong, never
INTERNAL or a stack trace, and every KV block is free afterwards (docs/design.md, "What bad input gets")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvpact.client import AsyncClient, Client, KvpactRpcError
from tests.factories.processes import running, started_worker, wait_for_health
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import START_S, router_address, router_argv, wait_all_blocks_free

MAX_MODEL_LEN = 2048
LONG = 1800  # new tokens: seconds of work for the tiny model, so a request is surely still in flight
MAX_NUM_SEQS = 2
MAX_WAITING = 16
VOCAB = 384  # the tiny tokenizer's
INVALID, NOT_FOUND, DEADLINE = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
USER = [{"role": "user", "content": "hi"}]


class Cluster:
    def __init__(self, address: str, worker_address: str) -> None:
        self.address, self.worker_address = address, worker_address


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("bad-input")
    model = make_tiny_llama(log_dir / "model", max_position_embeddings=MAX_MODEL_LEN)
    worker_args = ["--model", str(model), "--model-name", "tiny", "--worker-id", "w-bad", "--paged-attn",
                   "on", "--max-num-seqs", str(MAX_NUM_SEQS), "--router-timeout", "30",
                   "--max-waiting", str(MAX_WAITING)]  # fmt: skip
    with running(router_argv("--paged-attn", "on"), name="router", log_dir=log_dir) as router:
        address = router_address(router)
        with started_worker(
            [*worker_args, "--router", address], log_dir=log_dir, wait_serving=False, timeout_s=START_S
        ) as worker:
            wait_for_health(address, START_S, watch=[router, worker.handle])
            yield Cluster(address, worker.address)
            assert router.returncode is None and worker.handle.returncode is None


CASES: list[tuple[str, Callable[[Client], object], grpc.StatusCode, str]] = [
    ("empty prompt", lambda c: c.complete(""), INVALID, "the prompt is empty"),
    ("empty prompt, streamed", lambda c: list(c.generate("")), INVALID, "the prompt is empty"),
    ("prompt past max_model_len", lambda c: c.complete("hello " * MAX_MODEL_LEN), INVALID,
     f"but max_model_len is {MAX_MODEL_LEN}, which leaves no room to generate; shorten the prompt"),
    ("max_tokens 0", lambda c: c.complete("hi", max_tokens=0), INVALID, "max_tokens must be >= 1, got 0"),
    ("max_tokens huge", lambda c: c.complete("hi", max_tokens=10**9), INVALID,
     f"more than max_model_len {MAX_MODEL_LEN}; lower max_tokens to at most"),
    ("temperature -1", lambda c: c.complete("hi", temperature=-1), INVALID, "temperature must be >= 0"),
    ("top_p 0", lambda c: c.complete("hi", top_p=0), INVALID, "top_p must be in (0, 1], got 0.0"),
    ("top_p 1.5", lambda c: c.complete("hi", top_p=1.5), INVALID, "top_p must be in (0, 1], got 1.5"),
    ("top_k -1 (uint32 on the wire)", lambda c: c.complete("hi", top_k=-1), INVALID,
     "top_k must be in [0, 4294967295] (0 = disabled), got -1"),
    ("repetition_penalty 0", lambda c: c.complete("hi", repetition_penalty=0), INVALID,
     "repetition_penalty must be > 0"),
    ("stop token id out of vocab", lambda c: c.complete("hi", stop_token_ids=[VOCAB]), INVALID,
     f"stop_token_ids must be in [0, {VOCAB}), got [{VOCAB}]"),
    ("prompt token id out of vocab", lambda c: c.complete([1, VOCAB + 5]), INVALID,
     f"prompt token ids must be in [0, {VOCAB}), got [{VOCAB + 5}]"),
    ("unknown model", lambda c: c.complete("hi", model="nope"), NOT_FOUND,
     "model 'nope' is not served here; served models: tiny"),
    ("chat, unknown role", lambda c: c.chat([*USER, {"role": "wizard", "content": "x"}]), INVALID,
     "chat message 1 has role 'wizard'; use one of system, user, assistant"),
    ("chat, no messages", lambda c: c.chat([]), INVALID, "send at least one chat message"),
    # Hostile but well-formed: each field over its documented cap (shared/limits.py), refused before any
    # rendering or tokenizing, the error quoting only a short prefix of the value.
    ("request_id of 3 MB", lambda c: c.complete("hi", request_id="r" * 3_000_000), INVALID,
     "request_id has 3000000 characters, more than the cap of 128: 'rrrr"),
    ("model name of 3 MB", lambda c: c.complete("hi", model="m" * 3_000_000), INVALID,
     "model has 3000000 characters, more than the cap of 256"),
    ("a stop string of 128,000 characters", lambda c: c.complete("hi", stop=["x" * 128_000]), INVALID,
     "stop string 0 has 128000 characters, more than the cap of 256"),
    ("17 stop strings", lambda c: c.complete("hi", stop=[f"s{i}" for i in range(17)]), INVALID,
     "stop has 17 strings, more than the cap of 16"),
    ("330,000 tiny chat messages", lambda c: c.chat([{"role": "user", "content": "x"}] * 330_000), INVALID,
     "the chat has 330000 messages, more than the cap of 1024"),
    ("a prompt of 2 MB", lambda c: c.complete("y" * 2_000_000), INVALID,
     "the prompt is 2000000 bytes of text, more than the cap of 1048576 bytes"),
    ("a message over gRPC's 4 MiB limit", lambda c: c.complete("z" * 5_000_000),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("deadline 1 ms", lambda c: c.complete("hi", max_tokens=64, timeout=0.001), DEADLINE, "Deadline"),
    ("deadline mid-generation", lambda c: c.complete("hi", max_tokens=LONG, ignore_eos=True, timeout=0.2),
     DEADLINE, "Deadline"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "code", "phrase"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_specific_status_and_says_what_was_wrong(cluster, call, code, phrase):
    with Client(cluster.address, timeout=30) as client, pytest.raises(KvpactRpcError) as exc:
        call(client)
    assert (exc.value.code, phrase in exc.value.details) == (code, True), exc.value.details
    assert "Traceback" not in exc.value.details and len(exc.value.details) < 400
    assert "127.0.0.1:" not in exc.value.details  # no internal address reaches a client (issue 15)
    wait_all_blocks_free(cluster.worker_address)


def test_a_request_id_reused_while_in_flight_is_refused_and_the_first_goes_on(cluster):
    with Client(cluster.address, timeout=30) as client:
        first = client.generate("hi", max_tokens=LONG, ignore_eos=True, request_id="same")
        assert next(first).finish_reason is None  # in flight
        with pytest.raises(KvpactRpcError) as exc:
            client.complete("hi", max_tokens=4, request_id="same")
        assert exc.value.code is INVALID
        assert "request_id 'same' is already in flight; send a new request_id" in exc.value.details
        assert next(first).finish_reason is None  # still going
        first.close()  # cancels it
    wait_all_blocks_free(cluster.worker_address)


def test_extreme_but_valid_sampling_values_are_served(cluster):
    """A tiny temperature or repetition penalty once overflowed the logits to nan and failed the
    whole batch (this request and everyone else's in the step) with INTERNAL."""
    with Client(cluster.address, timeout=30) as client:
        for params in (dict(temperature=1e-45), dict(repetition_penalty=1e-38), dict(top_k=10**6)):
            reply = client.complete("hello hello", max_tokens=4, ignore_eos=True, **params)
            assert reply.usage is not None and reply.usage.completion_tokens == 4, params
    wait_all_blocks_free(cluster.worker_address)


def test_many_more_requests_than_sequences_queue_and_all_finish(cluster):
    async def run() -> list[int]:
        async with AsyncClient(cluster.address, timeout=60) as client:
            replies = await asyncio.gather(
                *(client.complete(f"n {i}", max_tokens=8, ignore_eos=True) for i in range(8 * MAX_NUM_SEQS))
            )
        return [r.usage.completion_tokens for r in replies if r.usage is not None]

    assert asyncio.run(run()) == [8] * (8 * MAX_NUM_SEQS)
    wait_all_blocks_free(cluster.worker_address)


def test_a_large_prompt_being_tokenized_does_not_starve_the_workers_event_loop(cluster):
    """Rendering and tokenizing run off the worker's event loop: while a chat of 1024 messages (just
    under the prompt cap) is rendered and tokenized, Stats (what heartbeats carry too) answers at once,
    and a normal request is served afterwards."""
    import threading

    from kvpact.v1 import worker_pb2, worker_pb2_grpc

    big = [{"role": "user", "content": "lorem ipsum dolor " * 56}] * 1024  # ~1 MB of text
    done: list[BaseException] = []

    def hostile() -> None:
        with Client(cluster.address, timeout=60) as client:
            try:
                client.chat(big, max_tokens=1)
            except KvpactRpcError as exc:
                done.append(exc)

    thread = threading.Thread(target=hostile)
    thread.start()
    latencies = []
    with grpc.insecure_channel(cluster.worker_address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        while thread.is_alive() and len(latencies) < 200:
            started = time.monotonic()
            stub.Stats(worker_pb2.StatsRequest(), timeout=5)
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    thread.join(60)
    assert done and done[0].code is INVALID and "max_model_len" in done[0].details  # too many tokens
    assert max(latencies) < 0.5, sorted(latencies)[-5:]  # tokenizing it alone takes ~1 s here
    with Client(cluster.address, timeout=30) as client:
        assert client.complete("hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    wait_all_blocks_free(cluster.worker_address)


def test_past_max_waiting_a_request_is_refused_at_once_and_the_accepted_ones_go_on(cluster):
    """2 running + 16 waiting fill the worker: the next request gets RESOURCE_EXHAUSTED at once, naming
    the limit and its value (the router found no other worker with room); the accepted ones go on."""
    from kvpact.v1 import worker_pb2, worker_pb2_grpc

    async def run() -> None:
        async with AsyncClient(cluster.address, timeout=60) as client:
            streams = [
                client.generate(f"s{i}", max_tokens=LONG, ignore_eos=True)
                for i in range(MAX_NUM_SEQS + MAX_WAITING)
            ]
            firsts = [asyncio.ensure_future(anext(s)) for s in streams]
            async with grpc.aio.insecure_channel(cluster.worker_address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                for _ in range(400):
                    load = await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                    if (load.num_running, load.num_waiting) == (MAX_NUM_SEQS, MAX_WAITING):
                        break
                    await asyncio.sleep(0.05)
                assert (load.num_running, load.num_waiting) == (MAX_NUM_SEQS, MAX_WAITING), load
            with pytest.raises(KvpactRpcError) as exc:
                await client.complete("one too many", max_tokens=4)
            assert exc.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (
                f"16 requests are already waiting for a place in the batch (--max-waiting {MAX_WAITING})"
                in (exc.value.details)
            )
            # The accepted ones go on: the running two stream (a request counts as running once scheduled,
            # and its first token can still be on its way to this client), the waiting ones stay queued.
            deadline = time.monotonic() + 30
            while sum(f.done() for f in firsts) < MAX_NUM_SEQS and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            running = [f for f in firsts if f.done()]
            assert len(running) == MAX_NUM_SEQS and all(f.result().finish_reason is None for f in running)
            for f in firsts:
                f.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for s in streams:
                await s.aclose()

    asyncio.run(run())
    wait_all_blocks_free(cluster.worker_address)
