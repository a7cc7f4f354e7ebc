"""TLS, mutual TLS and API keys on an in-process router, with worker doubles serving over (mutual) TLS.

Certificates are made in the test (tests/factories/certs.py). What is asserted is what a client or a
worker would see: the status code, the message, and that nothing secret or internal is in it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpact.client import AsyncClient, KvpactRpcError
from kvpact.router.cli import build_parser, config_from_args
from kvpact.router.server import RouterServer
from kvpact.shared.errors import ConfigError
from kvpact.shared.tls import TlsConfig, add_port, aio_channel, load_tls
from kvpact.v1 import worker_pb2, worker_pb2_grpc
from kvpact.worker.registration import RouterLink, RouterTlsError
from tests.factories.certs import CertificateAuthority, TlsFilePaths
from tests.factories.eventually import eventually_async
from tests.router.doubles import WorkerDouble, ready, registry_stub, run_async, running_router, serving_double

KEY, OTHER_KEY = "k-123-right", "k-456-other"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFilePaths]:
    root = tmp_path_factory.mktemp("pki")
    ca, stranger = CertificateAuthority.create("cluster CA"), CertificateAuthority.create("another CA")
    return {
        "router": ca.issue("router", root / "ca"),
        "worker": ca.issue("worker", root / "ca"),
        "client": ca.issue("client", root / "ca"),
        "stranger": stranger.issue("stranger", root / "stranger"),
    }


def tls_of(paths: TlsFilePaths, ca: Path | None = None) -> TlsConfig:
    tls = load_tls(str(paths.cert), str(paths.key), str(ca or paths.ca))
    assert tls is not None
    return tls


@asynccontextmanager
async def serving_tls_double(double: WorkerDouble, tls: TlsConfig) -> AsyncIterator[WorkerDouble]:
    """A worker double behind mutual TLS, as a worker with --tls-cert/--tls-key/--tls-ca serves."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServicer_to_server(double, server)
    port = add_port(server, "127.0.0.1:0", tls, require_client_cert=True)
    await server.start()
    double.address = f"127.0.0.1:{port}"
    try:
        yield double
    finally:
        await server.stop(None)


@asynccontextmanager
async def registry_over_tls(
    router: RouterServer, tls: TlsConfig
) -> AsyncIterator[worker_pb2_grpc.RegistryStub]:
    async with aio_channel(f"127.0.0.1:{router.port}", tls) as channel:
        yield worker_pb2_grpc.RegistryStub(channel)


def client(router: RouterServer, pki: dict[str, TlsFilePaths], **kwargs) -> AsyncClient:
    return AsyncClient(f"127.0.0.1:{router.port}", timeout=10, ca_file=str(pki["router"].ca), **kwargs)


@run_async
async def test_client_to_router_over_tls_and_router_to_worker_over_mutual_tls(pki):
    router_tls, worker_tls = tls_of(pki["router"]), tls_of(pki["worker"])
    async with (
        running_router(tls=router_tls) as router,
        serving_tls_double(WorkerDouble("a"), worker_tls) as a,
        registry_over_tls(router, worker_tls) as registry,
        client(router, pki) as tls_client,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=5) as plaintext_client,
    ):
        assert (await registry.Register(ready("a", a.address))).admitted
        reply = await tls_client.complete("hello", max_tokens=3)
        assert (reply.worker_id, reply.text) == ("a", "t5 t6 t7 ")
        assert [c.text async for c in tls_client.generate("hi", max_tokens=2)] == ["t2 ", "t3 "]
        with pytest.raises(KvpactRpcError) as err:  # a plaintext client cannot talk to a TLS router
            await plaintext_client.complete("hello", max_tokens=1)
        assert err.value.code is grpc.StatusCode.UNAVAILABLE


@run_async
async def test_a_worker_whose_certificate_another_ca_signed_is_refused_at_registration(pki):
    router_tls = tls_of(pki["router"])
    # It trusts the cluster CA (so it can reach the router) but its own certificate is the stranger's.
    stranger_tls = tls_of(pki["stranger"], ca=pki["router"].ca)
    async with (
        running_router(tls=router_tls) as router,
        serving_tls_double(WorkerDouble("x"), stranger_tls) as x,
        registry_over_tls(router, stranger_tls) as registry,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await registry.Register(ready("x", x.address))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        details = err.value.details()
        assert 'worker "x": the router dialed it back over TLS and the handshake failed' in details
        assert "CERTIFICATE_VERIFY_FAILED" in details and "--tls-ca" in details
        assert router.cluster.registry.get("x") is None


@run_async
async def test_a_worker_that_does_not_trust_the_routers_ca_cannot_even_reach_it(pki):
    stranger_tls = tls_of(pki["stranger"])
    async with running_router(tls=tls_of(pki["router"])) as router:
        link = RouterLink(
            f"127.0.0.1:{router.port}", worker_id="x", auth_token=None, timeout_s=5, tls=stranger_tls
        )
        try:
            with pytest.raises(RouterTlsError) as err:
                await link.register(ready("x", "127.0.0.1:1"))
        finally:
            await link.close()
        assert "TLS handshake with router" in str(err.value) and "CERTIFICATE_VERIFY_FAILED" in str(err.value)
        assert str(pki["stranger"].ca) in str(err.value)  # names the --tls-ca to check


@run_async
async def test_api_keys_missing_wrong_and_right_and_health_and_reflection_stay_open(pki):
    router_tls = tls_of(pki["router"])
    async with running_router(tls=router_tls, api_keys=(KEY,)) as router:
        calls = {"none": client(router, pki), "wrong": client(router, pki, api_key=OTHER_KEY)}
        for name, c in calls.items():
            async with c:
                for call in (c.complete("x"), c.list_models(), c.cluster_status()):
                    with pytest.raises(KvpactRpcError) as err:
                        await call
                    assert err.value.code is grpc.StatusCode.UNAUTHENTICATED, (name, err.value)
                    assert KEY not in err.value.details and OTHER_KEY not in err.value.details
                    phrase = "requires an API key" if name == "none" else "API key is not accepted"
                    assert phrase in err.value.details
                with pytest.raises(KvpactRpcError) as err:
                    [chunk async for chunk in c.generate("x")]
                assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
        async with client(router, pki, api_key=KEY) as right:
            status = await right.cluster_status()  # served (the cluster is still STARTING)
            assert status.expected_workers == 1
        async with aio_channel(f"127.0.0.1:{router.port}", tls_of(pki["client"])) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered, without a key
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = [
                r
                async for r in reflection.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
            ]
            names = {s.name for s in replies[0].list_services_response.service}
            assert "kvpact.v1.Generation" in names


@run_async
async def test_key_and_token_rotation_keeps_a_stream_in_flight(pki, tmp_path):
    keys, tokens = tmp_path / "keys", tmp_path / "tokens"
    keys.write_text(f"{KEY}\n")
    tokens.write_text("token-1\n")
    double = WorkerDouble("a", delay_s=0.05)
    secrets = dict(
        api_keys=(KEY,), api_key_file=str(keys), auth_tokens=("token-1",), auth_token_file=str(tokens)
    )
    async with (
        running_router(**secrets) as router,
        serving_double(double) as a,
        registry_stub(router) as registry,
    ):
        admission = await registry.Register(ready("a", a.address, token="token-1"))
        assert admission.admitted
        rid = admission.registration_id
        old = AsyncClient(f"127.0.0.1:{router.port}", timeout=10, api_key=KEY)
        new = AsyncClient(f"127.0.0.1:{router.port}", timeout=10, api_key=OTHER_KEY)
        async with old, new:
            stream = old.generate("hi", max_tokens=20)
            first = await anext(stream)
            keys.write_text(f"# rotated\n{OTHER_KEY}\n")
            tokens.write_text("token-2\ntoken-1\n")  # the new one first, the old one until workers have it
            router.reload_secrets()  # what SIGHUP calls (the process-level SIGHUP: tests/integration)
            rest = [c async for c in stream]
            assert [first, *rest][-1].finish_reason == "length" and len(rest) == 19  # not dropped
            with pytest.raises(KvpactRpcError) as err:
                await old.complete("x", max_tokens=1)
            assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
            assert (await new.complete("x", max_tokens=1)).worker_id == "a"
            for token in ("token-1", "token-2"):
                beat = worker_pb2.HeartbeatRequest(worker_id="a", auth_token=token, registration_id=rid)
                assert (await registry.Heartbeat(beat)).known
            tokens.write_text("token-2\n")
            router.reload_secrets()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="a", auth_token="token-1"))
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            keys.write_text("")  # a botched edit: the keys in force stay
            router.reload_secrets()
            assert (await new.complete("x", max_tokens=1)).worker_id == "a"
        await eventually_async(lambda: not double.active, what="the stream to end")


@run_async
async def test_an_unreachable_worker_is_named_but_its_address_never_reaches_the_client():
    async with (
        running_router() as router,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=5) as c,
    ):
        await registry.Register(ready("gone", "127.0.0.1:1"))
        with pytest.raises(KvpactRpcError) as err:
            await c.complete("x", request_id="rid-7")
        assert err.value.code is grpc.StatusCode.UNAVAILABLE
        assert 'worker "gone"' in err.value.details and "rid-7" in err.value.details
        assert "127.0.0.1" not in err.value.details


def test_tls_files_are_checked_when_read(tmp_path, pki):
    with pytest.raises(ConfigError, match="--tls-key is missing"):
        load_tls(str(pki["router"].cert), None)
    with pytest.raises(ConfigError, match=r"--tls-cert .*nope\.crt: cannot read it"):
        load_tls(str(tmp_path / "nope.crt"), str(pki["router"].key))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="--tls-ca .*junk.pem: not a PEM file"):
        load_tls(str(pki["router"].cert), str(pki["router"].key), str(tmp_path / "junk.pem"))
    tls = load_tls(str(pki["router"].cert), str(pki["router"].key))
    assert tls is not None and not tls.mutual and b"PRIVATE KEY" not in repr(tls).encode()
    assert load_tls(None, None) is None


def test_router_config_from_flags_reads_keys_and_tls_and_the_repr_shows_no_secret(tmp_path, pki):
    keys = tmp_path / "keys"
    keys.write_text(f"\n# clients\n{KEY}\n{OTHER_KEY}\n")
    args = build_parser().parse_args(["--api-key-file", str(keys), *pki["router"].flags()])
    config = config_from_args(args)
    assert config.api_keys == (KEY, OTHER_KEY) and config.tls is not None and config.tls.mutual
    assert KEY not in repr(config) and "PRIVATE" not in repr(config)
