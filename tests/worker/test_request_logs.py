"""Request-scoped log lines carry request_id and worker_id; prompt text appears only with --log-prompts."""

from __future__ import annotations

import json

import grpc
import pytest

from kvpact.v1 import generation_pb2, worker_pb2_grpc
from tests.factories.processes import started_worker

SECRET = "the launch codes are 0000"


@pytest.mark.parametrize("log_prompts", [False, True], ids=["default", "log-prompts"])
def test_request_lines_name_request_and_worker_and_hide_the_prompt_unless_asked(
    tiny_llama, tmp_path, log_prompts
):
    args = ["--model", str(tiny_llama), "--worker-id", "w-log", "--log-level", "DEBUG"]
    args += ["--log-prompts"] if log_prompts else []
    with started_worker(args, log_dir=tmp_path) as worker:
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            request = generation_pb2.GenerateRequest(request_id="r-1", text=SECRET, max_tokens=2)
            assert list(stub.Generate(request, timeout=30))
            bad = generation_pb2.GenerateRequest(request_id="r-2", text=SECRET, max_tokens=10**6)
            with pytest.raises(grpc.RpcError):
                list(stub.Generate(bad, timeout=30))
        stderr = worker.handle.stderr()
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    scoped = [line for line in lines if "request_id" in line]
    assert {line["request_id"] for line in scoped} == {"r-1", "r-2"}
    assert all(line["worker_id"] == "w-log" for line in scoped)
    assert all(line.get("worker_id") == "w-log" for line in lines)  # every line names its worker
    [received] = [line for line in scoped if line["event"] == "request" and line["request_id"] == "r-1"]
    assert received["prompt_kind"] == "text" and received["prompt_chars"] == len(SECRET)
    assert (SECRET in stderr) is log_prompts
    if log_prompts:
        assert received["prompt"] == SECRET
