"""Proof under load (issue 11, item 7), with a real router and two real workers on loopback.

- soak: hundreds of requests of mixed lengths from several concurrent clients, ~20% cancelled at random
  points, some with short deadlines; at the end every worker has every KV block free and nothing
  running or waiting, and its RSS stopped growing over the second half (500 requests of up to 8 new
  tokens by default, sized for the suite on a loaded 2-core box; 3000 of up to 64 under the slow marker).
- fuzz: hypothesis drives random GenerateRequests (random fields, sizes up to past the message limit,
  unicode, token ids, sampling values) at the router: each reply is a valid stream or INVALID_ARGUMENT /
  RESOURCE_EXHAUSTED (NOT_FOUND for a random model name), never INTERNAL or UNKNOWN, none takes more than
  a few seconds, a concurrent normal stream keeps its pace, and a normal request is served afterwards.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpact.client import AsyncClient, Client, KvpactRpcError
from kvpact.v1 import generation_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.factories.processes import rss_bytes, running, started_worker, wait_for_health
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import (
    MAX_MODEL_LEN,
    START_S,
    router_address,
    router_argv,
    wait_all_blocks_free,
    worker_args,
)

VOCAB = 384  # the tiny tokenizer's
NUM_CLIENTS = 16


class Cluster:
    def __init__(self, address: str, workers: dict[str, tuple[str, int]]) -> None:
        self.address = address
        self.workers = workers  # worker id -> (address, pid)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("proof")
    model = make_tiny_llama(log_dir / "model", max_position_embeddings=int(MAX_MODEL_LEN))
    with running(
        router_argv("--paged-attn", "on", "--expect-workers", "2"), name="router", log_dir=log_dir
    ) as r:
        address = router_address(r)
        ids = ("w-p1", "w-p2")
        args = {w: worker_args(model, address, w, "--paged-attn", "on", "--max-num-seqs", "16") for w in ids}
        with (
            started_worker(
                args[ids[0]], log_dir=log_dir, name=ids[0], wait_serving=False, timeout_s=START_S
            ) as a,
            started_worker(
                args[ids[1]], log_dir=log_dir, name=ids[1], wait_serving=False, timeout_s=START_S
            ) as b,
        ):
            wait_for_health(address, START_S, watch=[r, a.handle, b.handle])
            yield Cluster(address, {ids[0]: (a.address, a.handle.pid), ids[1]: (b.address, b.handle.pid)})
            assert r.returncode is None and a.handle.returncode is None and b.handle.returncode is None


def soak(cluster: Cluster, num_requests: int, max_new_tokens: int, seed: int = 11) -> None:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    rss: dict[str, list[int]] = {w: [] for w in cluster.workers}
    pending = list(range(num_requests))

    async def client_loop(client: AsyncClient) -> None:
        while pending:
            i = pending.pop()
            prompt = " ".join(
                rng.choice(("the", "fox", "jumps", "over", "a", "lazy", "dog"))
                for _ in range(rng.randint(1, 60))
            )
            max_tokens = rng.randint(1, max_new_tokens)
            roll = rng.random()
            try:
                if roll < 0.2:  # cancelled at a random point
                    stop_after = rng.randint(0, 4)
                    stream = client.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
                    n = 0
                    async for _ in stream:
                        n += 1
                        if n > stop_after:
                            break
                    await stream.aclose()
                    outcomes["CANCELLED (by the client)" if n > stop_after else "OK"] += 1
                elif roll < 0.3:  # a short deadline
                    await client.complete(
                        prompt, max_tokens=max_tokens, ignore_eos=True, timeout=rng.uniform(0.01, 0.3)
                    )
                    outcomes["OK"] += 1
                else:
                    reply = await client.complete(prompt, max_tokens=max_tokens, ignore_eos=True, timeout=60)
                    assert reply.usage is not None and reply.usage.completion_tokens == max_tokens
                    outcomes["OK"] += 1
            except KvpactRpcError as exc:
                outcomes[exc.code.name] += 1
            if i % 25 == 0:
                for w, (_, pid) in cluster.workers.items():
                    rss[w].append(rss_bytes(pid))

    async def run() -> None:
        async with AsyncClient(cluster.address, timeout=60) as client:
            await asyncio.gather(*(client_loop(client) for _ in range(NUM_CLIENTS)))

    started = time.monotonic()
    asyncio.run(run())
    seconds = round(time.monotonic() - started, 1)
    loads = {w: wait_all_blocks_free(addr) for w, (addr, _) in cluster.workers.items()}
    growth = {w: round((s[-1] - s[len(s) // 2]) / 2**20, 1) for w, s in rss.items()}
    print(f"soak: {num_requests} requests in {seconds} s, statuses {dict(outcomes)}, "
          f"leaked blocks {sum(x.num_total_blocks - x.num_free_blocks for x in loads.values())}, "
          f"RSS growth over the second half (MiB) {growth}")  # fmt: skip
    assert sum(outcomes.values()) == num_requests
    assert set(outcomes) <= {"OK", "CANCELLED (by the client)", "DEADLINE_EXCEEDED"}, outcomes
    assert outcomes["CANCELLED (by the client)"] >= num_requests // 10
    for w, samples in rss.items():
        assert samples[-1] - samples[len(samples) // 2] < 32 * 2**20, (w, samples)  # stopped growing


@pytest.mark.parametrize(
    ("num_requests", "max_new_tokens"),
    [pytest.param(500, 8, id="500x8"), pytest.param(3000, 64, id="3000x64", marks=pytest.mark.slow)],
)
def test_soak_leaves_every_block_free_and_memory_flat(
    cluster: Cluster, num_requests: int, max_new_tokens: int
):
    soak(cluster, num_requests, max_new_tokens)


# ---- fuzz ----

TEXT = st.text(max_size=200)
HUGE = st.integers(0, 5_000_000).map(lambda n: "x" * n)  # up to past the 4 MiB message limit
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(0, 2, width=32))


FIELDS = ("request_id", "model", "stop", "stop_token_ids", "prompt", "sampling", "max_tokens")


@st.composite
def requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """Servable in every field but one (or none, or all): streams are exercised as much as refusals."""
    wild_field = draw(st.sampled_from((None, None, "all", *FIELDS)))

    def pick(field: str, sane: st.SearchStrategy, wild: st.SearchStrategy):  # type: ignore[no-untyped-def]
        return draw(wild if wild_field in (field, "all") else sane)

    msg = generation_pb2.GenerateRequest(
        request_id=pick("request_id", st.just(""), st.text(max_size=200)),
        model=pick("model", st.sampled_from(["", "tiny"]), st.text(max_size=300)),
        stop=pick(
            "stop", st.lists(st.text(max_size=4), max_size=2), st.lists(st.text(max_size=400), max_size=20)
        ),
        stop_token_ids=pick(
            "stop_token_ids",
            st.lists(st.integers(0, VOCAB - 1), max_size=3),
            st.lists(st.integers(0, 2**32 - 1), max_size=300),
        ),
        ignore_eos=draw(st.booleans()),
    )
    which = draw(st.sampled_from(["text", "chat", "token_ids"] + (["huge", "none"] if wild_field else [])))
    if which == "text":
        msg.text = pick("prompt", st.text(min_size=1, max_size=200), st.text(max_size=200))
    elif which == "huge":
        msg.text = draw(HUGE)
    elif which == "chat":
        roles = st.sampled_from(["user", "system", "assistant"])
        for _ in range(pick("prompt", st.integers(1, 4), st.integers(0, 1100))):
            msg.chat.messages.add(role=pick("prompt", roles, st.text(max_size=40)), content=draw(TEXT))
    elif which == "token_ids":
        ids = pick("prompt", st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=400),
                   st.lists(st.integers(0, 2**32 - 1), max_size=400))  # fmt: skip
        msg.token_ids.ids.extend(ids)
    sampling = msg.sampling
    for name, valid in (("temperature", st.floats(0, 2)), ("top_p", st.floats(0.01, 1)),
                        ("repetition_penalty", st.floats(0.5, 2))):  # fmt: skip
        if draw(st.booleans()):
            setattr(sampling, name, pick("sampling", valid, FLOATS))
    sampling.min_p = pick("sampling", st.just(0.0), FLOATS)
    sampling.top_k = pick("sampling", st.integers(0, 50), st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    sampling.logprobs = draw(st.booleans())
    max_tokens = pick("max_tokens", st.integers(1, 8), st.one_of(st.none(), st.integers(0, 2**32 - 1)))
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    return msg


ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.NOT_FOUND}  # fmt: skip


def test_fuzzed_requests_get_a_stream_or_a_specific_status_quickly_and_others_keep_their_pace(cluster):
    gaps: list[float] = []
    stop = threading.Event()

    def steady() -> None:  # a normal stream beside the fuzz: its chunks keep coming
        with Client(cluster.address, timeout=120) as client:
            while not stop.is_set():
                last = time.monotonic()
                for _ in client.generate("steady pace", max_tokens=400, ignore_eos=True):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if stop.is_set():
                        break

    thread = threading.Thread(target=steady)
    thread.start()
    seen: Counter[str] = Counter()
    slowest = [0.0]
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = router_pb2_grpc.GenerationStub(channel)

            @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(request=requests())
            def one(request: generation_pb2.GenerateRequest) -> None:
                started = time.monotonic()
                first = None  # seconds to the first chunk or the error: what "a reply" is here
                code = grpc.StatusCode.OK
                call = stub.Generate(request, timeout=30)
                try:
                    for n, chunk in enumerate(call):
                        first = first or time.monotonic() - started
                        if chunk.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED or n >= 16:
                            break  # a valid stream; a long one (max_tokens unset) is not waited out
                    call.cancel()
                except grpc.RpcError as exc:
                    first = first or time.monotonic() - started
                    code = exc.code()
                    assert len(exc.details() or "") < 1000
                slowest[0] = max(slowest[0], first or 0.0)
                seen[code.name] += 1
                assert code in ALLOWED, (code, request.ListFields()[:3])
                assert first is not None and first < 5.0, (first, code)

            one()
    finally:
        stop.set()
        thread.join(60)
    print(f"fuzz: statuses {dict(seen)}, slowest first reply {slowest[0]:.2f} s, "
          f"steady stream: {len(gaps)} chunks, largest gap {max(gaps):.2f} s")  # fmt: skip
    # A liveness bound, not a pace target (docs/performance.md judges ITL under load): no fuzzed request
    # may hold the steady stream back for long. The gaps include each new steady stream's first token,
    # admitted beside the fuzz's prefills, on 2 cores shared with another test file's processes: CI runs
    # read 2.00 and 2.51 s at worst; a stalled step loop or a starved stream reads tens of seconds.
    assert gaps and max(gaps) < 5.0, (max(gaps), gaps.index(max(gaps)), len(gaps))
    with Client(cluster.address, timeout=30) as client:
        assert client.complete("after the fuzz", max_tokens=4, ignore_eos=True).usage.completion_tokens == 4
    for addr, _ in cluster.workers.values():
        wait_all_blocks_free(addr)
    with grpc.insecure_channel(next(iter(cluster.workers.values()))[0]) as channel:
        assert (
            worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5).num_running == 0
        )
