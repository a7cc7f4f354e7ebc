"""HOST:PORT as kvpact writes it: one function, so an IPv6 host is bracketed everywhere (`[::1]:50051`)
and every address parses back with `kvpact.shared.cli.host_port`, its inverse."""

from __future__ import annotations


def join_host_port(host: str, port: int) -> str:
    """`127.0.0.1:50051`, `[::1]:50051`; a host already in brackets is kept as it is."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
