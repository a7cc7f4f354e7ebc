"""A real `router` and `worker` over mutual TLS, with client API keys and the shared token, on loopback.

Certificates come from a CA made in the test (tests/factories/certs.py). One cluster (router + one tiny
worker) is shared by the module; a worker with a certificate from another CA is started against it and
must be refused, each side saying why. Every process is stopped by pid; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpact.client import Client, KvpactRpcError
from tests.factories.certs import CertificateAuthority, TlsFilePaths
from tests.factories.eventually import eventually
from tests.factories.processes import ProcessHandle, running, started_worker, wait_for_exit
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import MAX_MODEL_LEN, START_S, router_address, router_argv, worker_args

KEY, NEW_KEY = "client-key-1", "client-key-2"
TOKEN = "worker-token-1"
LONG = 2000  # tokens: long enough that a stream is surely in flight while the keys rotate (400 could
# all be sent before the reload once small decode steps ran in one C call)


@dataclass(slots=True)
class SecureCluster:
    address: str
    router: ProcessHandle
    worker: ProcessHandle
    pki: dict[str, TlsFilePaths]
    keys: Path
    token: Path
    model: Path
    log_dir: Path

    def client(self, api_key: str | None = KEY, **kwargs) -> Client:
        return Client(self.address, timeout=60, ca_file=str(self.pki["router"].ca), api_key=api_key, **kwargs)


def health_over_tls(address: str, ca: Path) -> str:
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes())) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def log_events(handle: ProcessHandle, event: str) -> list[dict]:
    records = (json.loads(line) for line in handle.stderr().splitlines() if line.startswith("{"))
    return [r for r in records if r.get("event") == event]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    root = tmp_path_factory.mktemp("secure")
    ca, stranger = CertificateAuthority.create("cluster CA"), CertificateAuthority.create("another CA")
    pki = {
        "router": ca.issue("router", root / "pki"),
        "worker": ca.issue("worker", root / "pki"),
        "stranger": stranger.issue("stranger", root / "stranger"),
    }
    keys, token = root / "api-keys", root / "token"
    keys.write_text(f"{KEY}\n")
    token.write_text(f"{TOKEN}\n")
    model = make_tiny_llama(root / "model", max_position_embeddings=int(MAX_MODEL_LEN))
    secrets = ["--api-key-file", str(keys), "--auth-token-file", str(token)]
    argv = router_argv(*pki["router"].flags(), *secrets)
    with running(argv, name="router", log_dir=root) as router:
        address = router_address(router)
        args = [
            *worker_args(model, address, "w-tls"),
            *pki["worker"].flags(),
            "--auth-token-file",
            str(token),
        ]
        with started_worker(args, log_dir=root, wait_serving=False, timeout_s=START_S) as worker:
            ca_file = pki["router"].ca
            eventually(lambda: health_over_tls(address, ca_file) == "SERVING", START_S, "the router SERVING")
            yield SecureCluster(address, router, worker.handle, pki, keys, token, model, root)
            assert router.returncode is None and worker.handle.returncode is None


def test_a_client_over_tls_with_the_right_key_is_served_and_without_one_is_not(cluster):
    with cluster.client() as client:
        reply = client.chat([{"role": "user", "content": "hi"}], max_tokens=4, ignore_eos=True)
        assert (reply.worker_id, reply.usage.completion_tokens) == ("w-tls", 4)
        with pytest.raises(KvpactRpcError) as bad:
            client.complete("hi", max_tokens=0)
        assert bad.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert 'worker "w-tls": ' in bad.value.details and "127.0.0.1:" not in bad.value.details
        assert "max_tokens must be >= 1, got 0 (request id " in bad.value.details
    for key in (None, "not-a-key"):
        with cluster.client(api_key=key) as client, pytest.raises(KvpactRpcError) as err:
            client.complete("hi", max_tokens=1)
        assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert health_over_tls(cluster.address, cluster.pki["router"].ca) == "SERVING"  # no key needed
    with Client(cluster.address, timeout=5, api_key=KEY) as plaintext, pytest.raises(KvpactRpcError) as err:
        plaintext.complete("hi", max_tokens=1)
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert KEY not in cluster.router.stderr() and TOKEN not in cluster.router.stderr()
    assert TOKEN not in cluster.worker.stderr() + cluster.worker.stdout()


def test_sighup_rotates_the_keys_without_dropping_a_stream_in_flight(cluster):
    with cluster.client(KEY) as old, cluster.client(NEW_KEY) as new:
        stream = old.generate("hi", max_tokens=LONG, ignore_eos=True)
        first = next(stream)
        assert first.finish_reason is None
        num_reloads = len(log_events(cluster.router, "secrets_reloaded"))
        cluster.keys.write_text(f"{NEW_KEY}\n")
        os.kill(cluster.router.pid, signal.SIGHUP)
        eventually(
            lambda: len(log_events(cluster.router, "secrets_reloaded")) >= num_reloads + 2, 10, "the reload"
        )
        chunks = [first, *stream]
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == LONG
        with pytest.raises(KvpactRpcError) as err:
            old.complete("hi", max_tokens=1)
        assert err.value.code is grpc.StatusCode.UNAUTHENTICATED
        assert new.complete("hi", max_tokens=1, ignore_eos=True).usage.completion_tokens == 1
    cluster.keys.write_text(f"{KEY}\n")
    os.kill(cluster.router.pid, signal.SIGHUP)
    eventually(lambda: _served_with(cluster, KEY), 10, "the old key again")
    assert cluster.router.returncode is None and cluster.worker.returncode is None


def _served_with(cluster: SecureCluster, key: str) -> bool:
    with cluster.client(key) as client:
        try:
            return client.complete("hi", max_tokens=1).worker_id == "w-tls"
        except KvpactRpcError:
            return False


def test_a_worker_with_a_certificate_from_another_ca_is_refused_both_sides_saying_why(cluster):
    # It trusts the cluster CA (it reaches the router), but its own certificate is another CA's.
    stranger = cluster.pki["stranger"]
    tls = [
        "--tls-cert",
        str(stranger.cert),
        "--tls-key",
        str(stranger.key),
        "--tls-ca",
        str(cluster.pki["router"].ca),
    ]
    args = [
        *worker_args(cluster.model, cluster.address, "w-stranger"),
        *tls,
        "--auth-token-file",
        str(cluster.token),
    ]
    with started_worker(args, log_dir=cluster.log_dir, name="stranger", wait_serving=False) as w:
        assert wait_for_exit(w.handle, START_S) == 1
        said = w.handle.stderr()
        assert 'worker "w-stranger": the router dialed it back over TLS and the handshake failed' in said
        assert "CERTIFICATE_VERIFY_FAILED" in said and "engine ready" not in said  # refused before loading
    [refused] = [
        r for r in log_events(cluster.router, "worker_tls_refused") if r["worker_id"] == "w-stranger"
    ]
    assert "CERTIFICATE_VERIFY_FAILED" in refused["reason"] and refused["ca"] == str(cluster.pki["router"].ca)


def test_a_worker_that_trusts_another_ca_stops_at_once_naming_its_tls_ca(cluster):
    stranger = cluster.pki["stranger"]
    args = [*worker_args(cluster.model, cluster.address, "w-lost"), *stranger.flags()]
    started = time.monotonic()
    with started_worker(args, log_dir=cluster.log_dir, name="lost", wait_serving=False) as w:
        assert wait_for_exit(w.handle, START_S) == 1
        said = w.handle.stderr()
    assert f"TLS handshake with router {cluster.address} failed" in said and str(stranger.ca) in said
    assert time.monotonic() - started < 30  # not after --router-timeout's retries
