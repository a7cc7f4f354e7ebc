"""TLS for every kvpact channel: the files (--tls-cert, --tls-key, --tls-ca), read once at start, and the
gRPC credentials both sides build from them.

Who checks whom (one certificate and key per process, for serving and for dialing):

- client -> router: the router's certificate, verified by the client (its CA file, or the system roots).
- worker -> router (Registry): the router's certificate, verified against the worker's --tls-ca; the
  worker proves itself with --auth-token-file, and the router dials it back (below).
- router -> worker: the worker's certificate, verified against the router's --tls-ca; the router presents
  its own, and a worker with --tls-ca requires it (mutual TLS: only holders of a certificate the CA signed
  may call a worker).

The router's port takes clients that hold no certificate (they bring an API key), so it cannot require
one there; instead, a worker registering with a TLS router is dialed back over mutual TLS before it is
admitted (router/tls_probe.py): a worker whose certificate the router's CA did not sign is refused.

Without --tls-ca, peers are verified against the system's trusted roots and no client certificate is
asked for. --tls-server-name overrides the name a peer's certificate must carry (default: the host being
dialed), so one certificate (e.g. from a Kubernetes Secret mounted on every node) can serve every worker.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvpact.shared.errors import ConfigError

PEM_MARKER = b"-----BEGIN "
_HANDSHAKE_FAILED = re.compile(r"(?:\w+ )?handshake failed.*", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """The PEM bytes of this process's certificate chain and key, and of the CA that signs its peers."""

    cert_file: str
    key_file: str
    ca_file: str | None
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)  # never logged
    ca: bytes | None = field(repr=False)
    server_name: str | None = None

    @property
    def mutual(self) -> bool:
        """With --tls-ca, peers are verified against it and workers require the router's certificate."""
        return self.ca is not None


def add_tls_args(parser: argparse.ArgumentParser, role: str) -> None:
    """--tls-cert, --tls-key, --tls-ca and --tls-server-name, the same on the router and the worker."""
    group = parser.add_argument_group("TLS (docs/security.md)")
    group.add_argument(
        "--tls-cert",
        metavar="PATH",
        help=f"PEM certificate chain of this {role}; with --tls-key, every channel it serves or dials uses "
        "TLS (default: plaintext, fine on loopback only)",
    )
    group.add_argument("--tls-key", metavar="PATH", help="PEM private key of --tls-cert (never logged)")
    group.add_argument(
        "--tls-ca",
        metavar="PATH",
        help="PEM CA certificate(s) that sign the cluster's certificates: mutual TLS between router and "
        "workers (default: the system's trusted roots, no client certificates)",
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name peers' certificates must carry (default: the host dialed)",
    )


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    return load_tls(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def load_tls(
    cert_file: str | None, key_file: str | None, ca_file: str | None = None, server_name: str | None = None
) -> TlsConfig | None:
    """Read the files (once, at start); None when no TLS flag is given. ConfigError names the flag."""
    if not (cert_file or key_file or ca_file or server_name):
        return None
    if not (cert_file and key_file):
        missing = "--tls-key" if cert_file else "--tls-cert"
        raise ConfigError(
            f"TLS needs both --tls-cert and --tls-key; {missing} is missing (--tls-ca and --tls-server-name "
            "only work with them)"
        )
    return TlsConfig(
        cert_file=cert_file,
        key_file=key_file,
        ca_file=ca_file,
        cert=_read_pem("--tls-cert", cert_file),
        key=_read_pem("--tls-key", key_file),
        ca=_read_pem("--tls-ca", ca_file) if ca_file else None,
        server_name=server_name,
    )


def _read_pem(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from exc
    if PEM_MARKER not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def server_credentials(tls: TlsConfig, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """The serving side; `require_client_cert` (with --tls-ca) refuses peers without a certificate
    that CA signed."""
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)],
        root_certificates=tls.ca,
        require_client_auth=require_client_cert and tls.ca is not None,
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """The dialing side: the peer verified against --tls-ca (else the system roots); this process's own
    certificate presented when the peer asks for one."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )


def channel_options(tls: TlsConfig | None) -> list[tuple[str, Any]]:
    if tls is None or not tls.server_name:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]


def aio_channel(
    target: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`: TLS when configured, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(
        target, channel_credentials(tls), options=[*options, *channel_options(tls)]
    )


def add_port(
    server: grpc.aio.Server, address: str, tls: TlsConfig | None, *, require_client_cert: bool
) -> int:
    """Bind `address` (TLS when configured); the bound port, 0 if it could not be bound."""
    try:
        if tls is None:
            port: int = server.add_insecure_port(address)
        else:
            credentials = server_credentials(tls, require_client_cert=require_client_cert)
            port = server.add_secure_port(address, credentials)
        return port
    except RuntimeError:  # grpc's "Failed to bind to address"
        return 0


def handshake_failure(details: str | None) -> str | None:
    """The TLS reason inside a failed call's details ("Tls handshake failed ... CERTIFICATE_VERIFY_FAILED:
    ..."), or None when the call did not fail in a TLS handshake."""
    found = _HANDSHAKE_FAILED.search(details or "")
    return found.group(0).removesuffix(": OK").strip() if found else None


def describe_tls(tls: TlsConfig | None) -> str:
    """For the startup log: "off", "on" or "mutual"."""
    return "off" if tls is None else "mutual" if tls.mutual else "on"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and "localhost": reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plaintext_warning(host: str, tls: TlsConfig | None) -> str | None:
    """The startup warning for a plaintext port reachable from other machines, naming the flags to add."""
    if tls is not None or is_loopback(host):
        return None
    return (
        f"listening on {host} without TLS: anyone who can reach this port can read and send its traffic; "
        "add --tls-cert and --tls-key (and --tls-ca for mutual TLS between router and workers), or listen "
        "on 127.0.0.1"
    )
