"""`make serve` (python -m kvpact.deploy.local): a real router and a real worker as processes, on a tiny
model."""

from __future__ import annotations

import re
import signal

import openai
import pytest

from kvpact.client import Client
from tests.factories.processes import (
    alive,
    free_port,
    module_argv,
    running,
    stop,
    wait_for_exit,
    wait_for_line,
)
from tests.factories.tiny_models import make_tiny_llama

START_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_serve_starts_both_prints_how_to_use_them_and_ctrl_c_stops_both(model_dir, tmp_path):
    port, http_port = free_port(), free_port()
    argv = module_argv(
        "kvpact.deploy.local", "--port", str(port), "--model", str(model_dir), "--paged-attn", "on",
        "--http-port", str(http_port),
    )  # fmt: skip
    with running(argv, name="serve", log_dir=tmp_path) as serve:
        wait_for_line(serve, r"^Ctrl-C stops both\.$", START_TIMEOUT_S)
        out = serve.stdout()
        assert f"kvpact is serving on 127.0.0.1:{port}" in out
        # the worker's plan, printed before it serves: every feature, the fingerprint, the verdict
        plan = out[out.index("the worker's plan (worker --plan-only, exit 0; no weight loaded yet):") :]
        assert plan.index("verdict: ok (exit 0)") < plan.index("kvpact is serving on")
        assert re.search(r"^paged-attn\s+on\s+on$", plan, re.MULTILINE)
        assert "fingerprint: model sha256:" in plan
        assert "cluster SERVING  policy --paged-attn on  workers 1/1 admitted" in out
        assert re.search(r"^kind\s+PAGED$", out, re.MULTILINE)
        assert f"Client('127.0.0.1:{port}')" in out
        assert f"127.0.0.1:{port} kvpact.v1.Generation/Generate" in out
        assert f"curl -s http://127.0.0.1:{http_port}/v1/chat/completions" in out
        assert f"OpenAI(base_url='http://127.0.0.1:{http_port}/v1'" in out
        pids = [int(p) for p in re.findall(r"(?:router|worker) pid (\d+)", out)]
        assert len(pids) == 2

        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            completion = client.complete("Hello", max_tokens=4, temperature=0, ignore_eos=True)
        assert completion.usage.completion_tokens == 4
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
        reply = sdk.completions.create(
            model="", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 4

        assert stop(serve, sig=signal.SIGINT, grace_s=40) == 0, serve.output()
    assert serve.stdout().rstrip().endswith("stopped")
    assert not any(alive(pid) for pid in pids)


def test_serve_exits_non_zero_with_the_output_when_the_worker_cannot_start(tmp_path):
    argv = module_argv(
        "kvpact.deploy.local", "--port", str(free_port()), "--model", str(tmp_path / "missing")
    )
    with running(argv, name="serve", log_dir=tmp_path) as serve:
        assert wait_for_exit(serve, START_TIMEOUT_S) == 1, serve.output()
    err = serve.stderr()
    assert "router exited with code 1" in err
    assert "does not exist" in err  # the worker's reason, as the router's report and the worker's stderr say
