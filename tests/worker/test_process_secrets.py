"""A worker process re-reads its --auth-token-file on SIGHUP: the next heartbeats carry the new token, and
it keeps serving (the router side of rotation: tests/router/test_security.py)."""

from __future__ import annotations

import os
import signal

import grpc

from kvpact.v1 import worker_pb2
from tests.factories.eventually import eventually
from tests.factories.processes import running, wait_for_line, worker_argv
from tests.worker.test_process import START_TIMEOUT_S, RecordingRegistry, model_dir, serving  # noqa: F401


class RotatingRegistry(RecordingRegistry):
    """Accepts every token in `tokens` (a router mid-rotation lists the new and the old one)."""

    def __init__(self, tokens: set[str]) -> None:
        super().__init__()
        self.tokens = tokens

    def _check(self, token: str, context: grpc.ServicerContext) -> None:
        if token not in self.tokens:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")

    def Register(self, request, context):
        self._check(request.auth_token, context)
        self.handshakes.append(request)
        return self.plan_admission if request.WhichOneof("outcome") == "loading" else self.admission

    def Heartbeat(self, request, context):
        self._check(request.auth_token, context)
        self.heartbeats.append(request)
        return worker_pb2.HeartbeatReply(known=True)


def test_sighup_swaps_the_token_the_worker_sends(model_dir, tmp_path):  # noqa: F811 - the fixture
    token_file = tmp_path / "token"
    token_file.write_text("old-token\n")
    registry = RotatingRegistry({"old-token", "new-token"})
    with serving(registry) as router:
        args = ["--model", str(model_dir), "--router", router, "--worker-id", "w-rot"]
        with running(worker_argv(*args, "--auth-token-file", str(token_file)), log_dir=tmp_path) as worker:
            wait_for_line(worker, r"admitted by router", START_TIMEOUT_S)
            eventually(lambda: registry.heartbeats, 10, "a heartbeat")
            token_file.write_text("# rotated\nnew-token\nold-token\n")
            os.kill(worker.pid, signal.SIGHUP)
            eventually(lambda: registry.heartbeats[-1].auth_token == "new-token", 10, "the new token")
            registry.tokens.discard("old-token")
            num_beats = len(registry.heartbeats)
            eventually(lambda: len(registry.heartbeats) > num_beats + 2, 10, "more heartbeats")
            assert worker.returncode is None, worker.output()
            assert {h.auth_token for h in registry.heartbeats[num_beats:]} == {"new-token"}
    assert "token_reloaded" in worker.stderr() and "new-token" not in worker.stderr()
