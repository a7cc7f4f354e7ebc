"""`router --http-listen HOST:PORT`: uvicorn serving the OpenAI app as a task in the router's own loop.

The socket is bound here first (BindError names --http-listen; port 0 = a free one, the bound port is
printed), then handed to `uvicorn.Server.serve`. The router keeps its own signal handling (drain on
SIGTERM): uvicorn's is switched off. TLS is the router's own --tls-cert/--tls-key.

HTTP/1.1 is parsed and framed by httptools (uvicorn's C parser), not h11: h11 is pure Python and cost
the router's loop about a quarter more per streamed request (docs/openai.md, "The HTTP row's p99").
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import structlog
import uvicorn

from kvpact.router.http.app import build_app
from kvpact.router.service import GenerationService
from kvpact.shared.auth import SecretFile
from kvpact.shared.errors import BindError
from kvpact.shared.tls import TlsConfig

log = structlog.get_logger("router.http")

START_TIMEOUT_S = 10.0
STOP_GRACE_S = 1  # seconds; open connections get this long after the router decided to exit


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the router handles SIGINT/SIGTERM/SIGHUP itself
        yield


class HttpFront:
    def __init__(
        self,
        service: GenerationService,
        api_keys: SecretFile,
        host: str,
        port: int,
        tls: TlsConfig | None,
    ) -> None:
        self.host, self.port, self.tls = host, port, tls
        config = uvicorn.Config(
            build_app(service, api_keys),
            log_config=None,
            access_log=False,
            lifespan="off",
            http="httptools",  # a dependency (pyproject.toml): no silent fallback to the slower h11
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
            timeout_graceful_shutdown=STOP_GRACE_S,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def bind(self) -> int:
        """Bind the port (BindError naming --http-listen); returns the bound port. Before anything starts."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP
        # (base_events._set_nodelay), and an accepted socket takes its listener's proto. With proto 0 every
        # SSE event after the headers waited for the client's delayed ACK: ~40 ms (docs/openai.md).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise BindError("--http-listen", self.address) from exc
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._socket = sock
        return self.port

    async def start(self) -> int:
        """Serve on the bound port (bind() first); returns it once uvicorn has started."""
        if self._socket is None:
            self.bind()
        assert self._socket is not None
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            if loop.time() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {START_TIMEOUT_S} s")
            await asyncio.sleep(0.01)
        print(f"router http listening on {self.address}", flush=True)  # tests and deploy read it
        log.info("router_http_listening", address=self.address, tls=self.tls is not None)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, STOP_GRACE_S + 2.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
