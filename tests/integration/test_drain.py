"""Graceful drain with real processes (issue 11, items 3 and 7 "drain"; issue 23, the `drain` field).

A rolling restart of both workers of a cluster under steady load loses no request: each worker, sent
SIGTERM, tells the router it is draining (the router shows DRAINING and routes nothing new to it),
finishes what it has, deregisters and exits 0; restarted with the same id, it is admitted again. Then one
worker is drained by the router (the `drain` field of its heartbeat reply) the same way. Then
the router, sent SIGTERM with a stream in flight: health NOT_SERVING and new calls UNAVAILABLE at once,
the stream finishes, and it exits 0.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from kvpact.client import Client, KvpactRpcError
from kvpact.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from tests.factories.processes import (
    free_port,
    health_status,
    module_argv,
    running,
    wait_for_exit,
    wait_for_health,
    wait_for_line,
)
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import MAX_MODEL_LEN, START_S, log_events, router_address, router_argv

NUM_CLIENTS = 3
LAST_STREAM_TOKENS = 2000  # the stream in flight when the router gets SIGTERM
WORKER_LISTENING = r"^worker \S+ listening on (\S+)$"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=int(MAX_MODEL_LEN))


def worker(model: Path, router: str, worker_id: str, log_dir: Path):
    argv = module_argv("kvpact.worker", "--model", str(model), "--model-name", "tiny", "--router", router,
                       "--worker-id", worker_id, "--router-timeout", "30", "--max-model-len", MAX_MODEL_LEN,
                       "--drain-timeout", "20", "--listen", "127.0.0.1:0", "--log-format", "json",
                       )  # fmt: skip
    return running(argv, name=worker_id, log_dir=log_dir)


def states(client: Client) -> dict[str, int]:
    return {w.worker_id: w.state for w in client.cluster_status().workers}


def wait_admitted(client: Client, worker_ids: set[str]) -> None:
    deadline = time.monotonic() + START_S
    while {w for w, s in states(client).items() if s == router_pb2.WORKER_STATE_ADMITTED} != worker_ids:
        assert time.monotonic() < deadline, states(client)
        time.sleep(0.1)


def test_a_rolling_restart_under_steady_load_loses_no_request_then_the_router_drains(model, tmp_path):
    argv = router_argv("--expect-workers", "2", "--heartbeat-interval", "0.3", "--drain-timeout", "20")
    with running(argv, name="router", log_dir=tmp_path) as r, ExitStack() as workers:
        address = router_address(r)
        handles = {w: workers.enter_context(worker(model, address, w, tmp_path)) for w in ("w-1", "w-2")}
        wait_for_health(address, START_S, watch=[r, *handles.values()])
        outcomes: list[str] = []
        stop_load = threading.Event()

        def load(seed: int) -> None:
            rng = random.Random(seed)
            with Client(address, timeout=60) as client:
                while not stop_load.is_set():
                    try:
                        reply = client.complete("steady", max_tokens=rng.randint(4, 48), ignore_eos=True)
                        outcomes.append("OK" if reply.finish_reason == "length" else reply.finish_reason)
                    except KvpactRpcError as exc:
                        outcomes.append(f"{exc.code.name}: {exc.details}")

        clients = [threading.Thread(target=load, args=(i,)) for i in range(NUM_CLIENTS)]
        for t in clients:
            t.start()
        drain_s: dict[str, float] = {}
        with Client(address, timeout=30) as status_client:
            for worker_id in ("w-1", "w-2"):
                time.sleep(1.0)  # steady load on both
                sent = time.monotonic()
                handles[worker_id].popen.send_signal(signal.SIGTERM)
                assert wait_for_exit(handles[worker_id], 30) == 0, handles[worker_id].output()
                drain_s[worker_id] = round(time.monotonic() - sent, 2)
                assert worker_id not in states(status_client)  # deregistered
                handles[worker_id] = workers.enter_context(worker(model, address, worker_id, tmp_path))
                wait_for_line(handles[worker_id], WORKER_LISTENING, START_S)
                wait_admitted(status_client, {"w-1", "w-2"})
            time.sleep(1.0)
        stop_load.set()
        for t in clients:
            t.join(60)
        statuses = sorted({o.split(":")[0] for o in outcomes})
        print(f"rolling restart: {len(outcomes)} requests, drain times {drain_s} s, statuses {statuses}")
        assert outcomes and all(o == "OK" for o in outcomes), [o for o in outcomes if o != "OK"][:5]
        assert {e["worker_id"] for e in log_events(r, "worker_draining")} == {"w-1", "w-2"}
        assert {e["worker_id"] for e in log_events(r, "worker_left")} == {"w-1", "w-2"}

        # The router tells w-2 to drain (Registry.Drain, what kvpact-launch calls to scale a group down):
        # nothing new is routed to it, its next heartbeat reply says `drain`, it runs its SIGTERM drain
        # (its in-flight stream finishes), deregisters and exits 0.
        with Client(address, timeout=60) as client, grpc.insecure_channel(address) as channel:
            # A stream on w-2. Least outstanding sends the second stream to the other worker while the
            # first is in flight, but a tiny model's 200 tokens can all be sent before the next stream
            # is routed, so open streams until one is on w-2.
            streams, routed = [], []
            on_w2, first_w2 = None, None
            while on_w2 is None:
                assert len(streams) < 8, f"8 streams, none routed to w-2: {routed}"
                stream = client.generate(f"s{len(streams)}", max_tokens=200, ignore_eos=True)
                first = next(stream)
                streams.append(stream)
                routed.append(first.worker_id)
                if first.worker_id == "w-2":
                    on_w2, first_w2 = stream, first
            registry = worker_pb2_grpc.RegistryStub(channel)
            reply = registry.Drain(worker_pb2.DrainRequest(worker_id="w-2", reason="scale-down"), timeout=5)
            assert (reply.known, reply.state) == (True, "draining")
            assert not registry.Drain(worker_pb2.DrainRequest(worker_id="w-9"), timeout=5).known
            # Draining until its stream ends; on a loaded machine that can all happen (the tiny model's 200
            # tokens, the drain, the deregistration) before this call, and then it has left.
            assert states(client).get("w-2") in (router_pb2.WORKER_STATE_DRAINING, None)  # None: it left
            assert [client.complete(f"n{i}", max_tokens=1).worker_id for i in range(3)] == ["w-1"] * 3
            rest = list(on_w2)
            num_tokens = len(first_w2.token_ids) + sum(len(c.token_ids) for c in rest)
            assert rest[-1].finish_reason == "length" and num_tokens == 200  # its stream finished
            assert wait_for_exit(handles["w-2"], 30) == 0, handles["w-2"].output()
            assert "the router asked it to drain (scale-down)" in handles["w-2"].stdout()
            assert set(states(client)) == {"w-1"}  # it deregistered
            assert [e["worker_id"] for e in log_events(r, "worker_drain_requested")] == ["w-2"]
            for other in streams:
                if other is not on_w2:
                    list(other)

        # The router, SIGTERM with a stream in flight: long enough (about 2 s here) that it is still in flight
        # when the refused request is sent on a slow, loaded CI machine (300 tokens once ended first there).
        with Client(address, timeout=60) as client:
            stream = client.generate("last", max_tokens=LAST_STREAM_TOKENS, ignore_eos=True)
            first = next(stream)
            assert first.finish_reason is None
            sent = time.monotonic()
            r.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while health_status(address) != "NOT_SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            not_serving_s = round(time.monotonic() - sent, 2)
            with pytest.raises(KvpactRpcError) as err:
                client.complete("refused", max_tokens=1)
            assert (
                err.value.code is grpc.StatusCode.UNAVAILABLE
                and "the router is stopping" in err.value.details
            )
            rest = list(stream)
            num_tokens = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
            assert rest[-1].finish_reason == "length" and num_tokens == LAST_STREAM_TOKENS  # whole
            assert wait_for_exit(r, 30) == 0
            print(f"router drain: NOT_SERVING after {not_serving_s} s, exit 0 after "
                  f"{round(time.monotonic() - sent, 2)} s")  # fmt: skip


def test_a_restarted_router_admits_its_workers_again(model, tmp_path):
    """The router restarted on the same address: its workers (told it was stopping) keep beating, are
    unknown to the new router, register again (the same policy checks) and serve once admitted."""
    address = f"127.0.0.1:{free_port()}"
    argv = module_argv("kvpact.router", "--listen", address, "--log-format", "json", "--heartbeat-interval",
                       "0.3")  # fmt: skip
    with (
        running(argv, name="router-1", log_dir=tmp_path) as first,
        worker(model, address, "w-1", tmp_path) as w,
    ):
        wait_for_health(address, START_S, watch=[first, w])
        first.popen.send_signal(signal.SIGTERM)
        assert wait_for_exit(first, 30) == 0
        with running(argv, name="router-2", log_dir=tmp_path) as second:
            wait_for_health(address, START_S, watch=[second, w])
            with Client(address, timeout=30) as client:
                assert states(client) == {"w-1": router_pb2.WORKER_STATE_ADMITTED}
                assert client.complete("again", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        assert w.returncode is None  # it waited for a router instead of exiting


def test_a_stream_the_routers_drain_timeout_cuts_off_is_told_why(model, tmp_path):
    """SIGTERM with a long stream in flight and --drain-timeout 0.5: the stream ends UNAVAILABLE naming the
    flag and how far it got (not gRPC's bare "Cancelling all calls"), and the router still exits 0."""
    argv = router_argv("--drain-timeout", "0.5")
    with running(argv, name="router", log_dir=tmp_path) as router:
        address = router_address(router)
        with worker(model, address, "w-1", tmp_path) as w:
            wait_for_health(address, START_S, watch=[router, w])
            with Client(address, timeout=60) as client:
                stream = client.generate("a long one", max_tokens=2000, temperature=0, ignore_eos=True)
                received = len(next(stream).token_ids)
                router.popen.send_signal(signal.SIGTERM)
                with pytest.raises(KvpactRpcError) as info:
                    for chunk in stream:
                        received += len(chunk.token_ids)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
            message = info.value.details
            assert "--drain-timeout 0.5 s ran out before this stream finished" in message, message
            assert f"({received} tokens sent)" in message and received < 2000, (message, received)
            assert wait_for_exit(router, 30) == 0
