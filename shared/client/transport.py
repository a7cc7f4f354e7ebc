"""How kvpact.client reaches a router: plaintext or TLS channel credentials, and the API key metadata.

    open_channel("router:50051", (), aio=False, ca_file="ca.crt")   # TLS verified against ca.crt
    with_api_key(None, "k1")  # (("authorization", "Bearer k1"),)

Depends only on grpc, like the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack

import grpc


class TransportParams(TypedDict, total=False):
    """The TLS keyword arguments of Client and AsyncClient (none given = plaintext)."""

    tls: bool  # True: TLS, the router verified against the system's trusted roots
    ca_file: str | None  # PEM CA that signed the router's certificate (implies TLS)
    cert_file: str | None  # a client certificate, for a server that requires one (with key_file)
    key_file: str | None
    server_name: str | None  # the name the router's certificate must carry (default: the host dialed)
    credentials: grpc.ChannelCredentials | None  # ready-made credentials instead of the above


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def channel_credentials(**params: Unpack[TransportParams]) -> grpc.ChannelCredentials | None:
    """The channel credentials `params` ask for; None = plaintext."""
    if params.get("credentials") is not None:
        return params["credentials"]
    cert_file, key_file = params.get("cert_file"), params.get("key_file")
    if bool(cert_file) != bool(key_file):
        raise ValueError("cert_file and key_file go together (a client certificate and its key)")
    if not (params.get("tls") or params.get("ca_file") or cert_file):
        return None
    return grpc.ssl_channel_credentials(_read(params.get("ca_file")), _read(key_file), _read(cert_file))


def open_channel(
    target: str, options: Sequence[tuple[str, Any]], *, aio: bool, **params: Unpack[TransportParams]
) -> Any:
    """A grpc (or grpc.aio) channel to `target`, TLS when `params` ask for it."""
    credentials = channel_credentials(**params)
    extra = list(options)
    if params.get("server_name"):
        extra.append(("grpc.ssl_target_name_override", params["server_name"]))
    module: Any = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(target, options=extra)
    return module.secure_channel(target, credentials, options=extra)


def with_api_key(
    metadata: tuple[tuple[str, str], ...] | None, api_key: str | None
) -> tuple[tuple[str, str], ...] | None:
    """`metadata` plus `authorization: Bearer <api_key>` when there is a key."""
    items = metadata or ()
    if api_key:
        items = (*items, ("authorization", f"Bearer {api_key.strip()}"))
    return items or None
