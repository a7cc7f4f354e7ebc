"""The HTTP front's SSE stream when its client falls behind (router/coalesce.py through router/http/):
the tokens that are ready together go out as one `data:` event in OpenAI's chunk shape, every token
once and in order. (A client that keeps up gets each token as it comes: tests/router/test_coalesce.py.)"""

from __future__ import annotations

import asyncio
import json
import socket

from kvpact.v1 import generation_pb2
from tests.router.doubles import WorkerDouble, one_worker_router, run_async

# Fixed, small kernel buffers on both ends (no autotuning: Linux grows a loopback send buffer to 4 MiB),
# so the router's writes wait for a reader that stalls after a few hundred events, as a slow client's do.
RECEIVE_BUFFER = SEND_BUFFER = 16 * 1024  # bytes
LONG_STREAM = 3_000  # tokens of about 180 bytes of SSE each: far more than those buffers hold
STALL_S = 0.2  # the slow reader's pause after each read: far slower than the router writes


async def sse_events(port: int, body: dict, stall_s: float) -> list[dict]:
    """POST /v1/completions and read its SSE stream to [DONE] through a small receive window,
    sleeping `stall_s` after each read; the events' JSON."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=RECEIVE_BUFFER)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    received = bytearray()
    try:
        for _ in range(1_000_000):  # bounded; the stream ends long before
            data = await reader.read(RECEIVE_BUFFER)
            assert data, f"the connection closed before [DONE]: {bytes(received[-300:])!r}"
            received += data
            if b"data: [DONE]\n\n" in received[-len(data) - 16 :]:
                break
            if stall_s:
                await asyncio.sleep(stall_s)
    finally:
        writer.close()
    head, _, stream = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
    # chunked framing puts its size lines between events; each event is one `data: {...}` line
    return [json.loads(line[6:]) for line in stream.split(b"\n") if line.startswith(b"data: {")]


def assert_openai_chunks(events: list[dict], expected: list[int]) -> None:
    """One completion's stream, exactly: every token's text once and in order, each event a
    `text_completion` chunk of choice 0, finish_reason only on the last."""
    assert "".join(e["choices"][0]["text"] for e in events) == "".join(f"t{t} " for t in expected)
    for event in events:
        assert set(event) == {"id", "object", "created", "model", "choices"}
        assert event["object"] == "text_completion" and event["id"] == events[0]["id"]
        [choice] = event["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and choice["index"] == 0
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["length"]


@run_async
async def test_a_client_that_falls_behind_gets_the_ready_tokens_merged_into_one_event():
    n = LONG_STREAM
    body = {"model": "tiny", "prompt": "hello", "max_tokens": n, "stream": True}
    double = WorkerDouble("a")
    async with one_worker_router(double, http_listen=("127.0.0.1", 0)) as (router, _):
        assert router.http is not None and router.http._socket is not None
        # accepted connections inherit the listening socket's buffer size
        router.http._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        events = await sse_events(router.http.port, body, STALL_S)
    expected = WorkerDouble.tokens_for(generation_pb2.GenerateRequest(text="hello", max_tokens=n))
    assert_openai_chunks(events, expected)
    assert len(events) < n, f"{len(events)} events for {n} tokens: nothing was merged"
    assert max(e["choices"][0]["text"].count(" ") for e in events) > 1  # an event of several tokens
    assert events[0]["choices"][0]["text"] == f"t{expected[0]} "  # the first token went out alone
