"""The HTTP front's connections send each write at once: Nagle's algorithm is off on every accepted
socket. With it on, every SSE event after the response headers waited for the client's delayed ACK
(~40 ms on Linux): the first token of every HTTP stream arrived ~50 ms late (docs/openai.md)."""

from __future__ import annotations

import asyncio
import socket

from tests.router.doubles import WorkerDouble, one_worker_router, run_async


@run_async
async def test_every_accepted_http_connection_has_nagle_off():
    async with one_worker_router(WorkerDouble("a"), http_listen=("127.0.0.1", 0)) as (router, _):
        assert router.http is not None
        connections = []
        try:
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", router.http.port)
                connections.append(writer)
                writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")  # kept alive after the reply
                assert (await reader.readline()).startswith(b"HTTP/1.1 200"), "GET /health did not answer 200"
            accepted = list(router.http._server.server_state.connections)
            assert len(accepted) == 3, f"{len(accepted)} accepted connections for 3 opened"
            for protocol in accepted:
                sock = protocol.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), "TCP_NODELAY is off"
        finally:
            for writer in connections:
                writer.close()
