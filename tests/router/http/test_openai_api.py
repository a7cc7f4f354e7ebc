"""The OpenAI-compatible HTTP front (router/http/) through the official `openai` SDK and raw HTTP, against
a real `router --http-listen` and one `--paged-attn on` worker on a tiny Llama (one cluster per module).

Every parameter the front accepts has its end-to-end test here (penalties, logprobs and top_logprobs with
their token names, min_tokens, n, response_format); one it refuses gets a 400 naming it, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvpact.client import Client
from tests.factories.certs import CertificateAuthority
from tests.factories.eventually import eventually
from tests.factories.processes import (
    ProcessHandle,
    free_port,
    module_argv,
    running,
    started_worker,
    wait_for_health,
    wait_for_line,
)
from tests.factories.tiny_models import make_tiny_llama, tiny_tokenizer

KEY = "sk-test-key"
START_S = 90.0
MAX_IN_FLIGHT = 3
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The quick brown fox"}]


@dataclass
class Cluster:
    router: ProcessHandle
    grpc: str
    http: str
    metrics_port: int
    worker: str

    @property
    def base_url(self) -> str:
        return f"http://{self.http}/v1"

    def sdk(self, api_key: str = KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=5).read().decode()

    def load(self):
        with Client(self.grpc, timeout=10, api_key=KEY) as client:
            (worker,) = client.cluster_status().workers
            return worker.load


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("http")
    model = make_tiny_llama(root / "model", max_position_embeddings=2048)
    (root / "keys").write_text(KEY + "\n")
    metrics_port = free_port()
    argv = module_argv(
        "kvpact.router",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--log-level",
        "debug",
        "--api-key-file",
        str(root / "keys"),
        "--heartbeat-interval",
        "0.3",
        "--max-in-flight-per-worker",
        str(MAX_IN_FLIGHT),
        "--metrics-port",
        str(metrics_port),
    )
    with running(argv, name="router", log_dir=root) as router:
        grpc_address = wait_for_line(router, r"^router listening on (\S+)$", 15).group(1)
        http_address = wait_for_line(router, r"^router http listening on (\S+)$", 15).group(1)
        worker_args = [
            "--model",
            str(model),
            "--model-name",
            "tiny",
            "--router",
            grpc_address,
            "--worker-id",
            "w",
            "--paged-attn",
            "on",
            "--max-model-len",
            "2048",
        ]
        with started_worker(worker_args, log_dir=root, wait_serving=False, timeout_s=START_S) as worker:
            wait_for_health(grpc_address, START_S, watch=[router, worker.handle])
            yield Cluster(router, grpc_address, http_address, metrics_port, worker.address)


def events(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


# -- endpoints, wire format ----------------------------------------------------------------------------


def test_health_is_open_and_models_carry_the_realized_state(cluster: Cluster):
    health = httpx.get(f"http://{cluster.http}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "SERVING", "state": "serving"}
    (model,) = cluster.sdk().models.list().data
    assert model.id == "tiny" and model.object == "model"
    ext = model.model_extra["kvpact"]
    assert ext["policy"] == "auto" and ext["num_serving_workers"] == 1 and ext["max_model_len"] == 2048
    (worker,) = ext["workers"]
    assert worker["worker_id"] == "w" and worker["requested"] == {"paged_attn": "on"}
    assert worker["realized"]["kv_cache"] == "paged" and worker["realized"]["fallbacks"] == []
    assert ext["policies"] == {"paged-attn": "auto", "prefix-caching": "auto", "cpu-kernels": "auto",
                               "quant-kernels": "auto", "cuda-graphs": "auto"}  # fmt: skip
    features = {f["name"]: f for f in worker["realized"]["features"]}
    assert features["prefix-caching"]["realized"] is True
    assert (features["cuda-graphs"]["realized"], features["cuda-graphs"]["reason"]) == (
        False,
        "no-cuda-device",
    )


def test_every_v1_path_needs_the_key(cluster: Cluster):
    with pytest.raises(openai.AuthenticationError) as err:
        cluster.sdk(api_key="wrong").models.list()
    assert err.value.status_code == 401 and "not accepted" in err.value.message
    raw = httpx.post(f"{cluster.base_url}/chat/completions", json={"messages": CHAT}, timeout=10)
    assert raw.status_code == 401 and "Authorization: Bearer" in raw.json()["error"]["message"]


def test_chat_whole_and_greedy_equals_grpc(cluster: Cluster):
    reply = cluster.sdk().chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "tiny" and isinstance(reply.created, int)
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    with Client(cluster.grpc, timeout=30, api_key=KEY) as client:
        grpc_reply = client.chat(CHAT, max_tokens=12, temperature=0.0)
    assert choice.message.content == grpc_reply.text
    assert reply.usage.completion_tokens == len(grpc_reply.token_ids)


def test_chat_stream_with_usage_in_openais_framing(cluster: Cluster):
    body = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{cluster.base_url}/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = events(r)
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    *choice_chunks, usage_chunk = chunks
    assert choice_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in choice_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    assert all("usage" in c and c["usage"] is None for c in choice_chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    # the same chat again: its prompt's full blocks come from the prefix cache
    params = {k: v for k, v in body.items() if k != "ignore_eos"}
    stream = cluster.sdk().chat.completions.create(**params, extra_body={"ignore_eos": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_text_token_ids_and_several_prompts(cluster: Cluster):
    sdk = cluster.sdk()
    reply = sdk.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}, logprobs=0
    )
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    (choice,) = reply.choices
    assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 5
    assert len(choice.logprobs.tokens) == 5 and not any(
        t.startswith("token_id:") for t in choice.logprobs.tokens
    )
    assert reply.usage.completion_tokens == 5
    several = sdk.completions.create(
        model="tiny", prompt=["Hello", "Other"], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in several.choices] == [0, 1] and several.usage.completion_tokens == 6
    assert several.choices[0].text == reply.choices[0].text[: len(several.choices[0].text)]
    ids = sdk.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def test_async_sdk_streams_completions(cluster: Cluster):
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=cluster.base_url, api_key=KEY, max_retries=0) as sdk:
            stream = await sdk.completions.create(
                model="tiny",
                prompt="Hi",
                max_tokens=6,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return [chunk.choices[0].finish_reason async for chunk in stream]

    finishes = asyncio.run(main())
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}


# -- parameters refused, errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ],
)
def test_an_unhonored_parameter_is_a_400_naming_it(cluster: Cluster, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        cluster.sdk().chat.completions.create(model="tiny", messages=CHAT, extra_body=extra)
    assert err.value.status_code == 400 and err.value.param.startswith(param)
    assert param in err.value.message


def test_unknown_model_is_404_and_overload_is_429(cluster: Cluster):
    sdk = cluster.sdk()
    with pytest.raises(openai.NotFoundError) as err:
        sdk.chat.completions.create(model="nope", messages=CHAT)
    assert "nope" in err.value.message and err.value.code == "model_not_found"
    busy = [
        sdk.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(MAX_IN_FLIGHT)
    ]
    try:
        for stream in busy:
            next(iter(stream))
        with pytest.raises(openai.RateLimitError) as err:
            sdk.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
        assert err.value.response.headers["retry-after"] == "1"
        assert "--max-in-flight-per-worker" in err.value.message
    finally:
        for stream in busy:
            stream.close()


def test_bad_json_and_bad_values_are_400_never_500(cluster: Cluster):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{cluster.base_url}/chat/completions"
    assert httpx.post(url, content=b"{not json", headers=headers).status_code == 400
    for body in (
        {},
        {"messages": []},
        {"messages": CHAT, "seed": -1},
        {"messages": CHAT, "stop": 5},
        {"messages": CHAT, "stream_options": {"include_usage": True}},
    ):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    huge = {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    r = httpx.post(url, json=huge, headers=headers, timeout=30)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


# -- a client that goes away ---------------------------------------------------------------------------


def cancelled(cluster: Cluster) -> float:
    series = r'kvpact_router_requests_total\{api="http",code="CANCELLED",model="tiny"\} (\S+)'
    found = re.search(series, cluster.metrics())
    return float(found.group(1)) if found else 0.0


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(cluster: Cluster):
    before = cancelled(cluster)
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 1900, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{cluster.base_url}/chat/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        eventually(lambda: cluster.load().num_running == 1, 10, "the worker to report the running request")
        busy = cluster.load()
        assert busy.num_free_blocks < busy.num_total_blocks
    load = eventually(
        lambda: (lambda w: w if w.num_running == 0 and w.num_free_blocks == w.num_total_blocks else None)(
            cluster.load()
        ),
        10,
        "the worker to free every block",
    )
    assert load.num_waiting == 0
    eventually(lambda: cancelled(cluster) == before + 1, 10, "the router to count the request CANCELLED")


def test_metrics_and_logs_carry_the_api(cluster: Cluster):
    cluster.sdk().chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, user="alice")
    text = cluster.metrics()
    assert re.search(r'kvpact_router_time_to_first_token_seconds_count\{api="http",model="tiny"\} \d', text)
    logs = [json.loads(line) for line in cluster.router.stderr().splitlines() if line.startswith("{")]
    done = [r for r in logs if r.get("event") == "http_request_done" and r.get("user") == "alice"]
    assert done and done[-1]["worker_id"] == "w" and done[-1]["api"] == "http" and done[-1]["request_id"]


# -- once the worker honors them (branch sampling) -----------------------------------------------------


def test_n_completions_each_get_their_choice(cluster: Cluster):
    reply = cluster.sdk().chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=4,
        n=3,
        seed=1,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage.completion_tokens == 12
    stream = cluster.sdk().chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, n=2, stream=True, extra_body={"ignore_eos": True}
    )
    finished = [c.choices[0].index for c in stream if c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_top_logprobs_and_penalties_and_min_tokens(cluster: Cluster):
    reply = cluster.sdk().chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"min_tokens": 4},
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert reply.usage.completion_tokens == 4
    # every token named by its text, as an SDK user reads it: greedy, so each is its own first alternative
    names = [(t.token, [a.token for a in t.top_logprobs]) for t in content]
    assert all(token == top[0] and not token.startswith("token_id:") for token, top in names), names
    assert all(t.bytes == list(t.token.encode()) for t in content)


def test_logit_bias_forces_a_token_and_an_id_past_the_vocabulary_is_a_400_naming_it(cluster: Cluster):
    sdk = cluster.sdk()
    fox = tiny_tokenizer().encode(" fox", add_special_tokens=False).ids[-1]
    reply = sdk.completions.create(
        model="tiny", prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(fox): 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].text == tiny_tokenizer().decode([fox] * 3)
    for bias, message in (
        ({"999999": 1}, "logit_bias token ids must be in"),
        ({"1": 101}, "less than or equal"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            sdk.completions.create(model="tiny", prompt="Hello", max_tokens=2, logit_bias=bias)
        assert err.value.body["param"] == "logit_bias" and message in err.value.body["message"]


def test_echo_with_logprobs_scores_the_prompt_as_an_evaluation_harness_asks(cluster: Cluster):
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, greedy; the prompt as token ids
    prompt = tiny_tokenizer().encode("The quick brown fox", add_special_tokens=False).ids
    with Client(cluster.grpc, timeout=30, api_key=KEY) as client:  # the sampled token's id and logprob
        sampled = client.complete(prompt, max_tokens=1, temperature=0, logprobs=True, ignore_eos=True)
        scored_grpc = client.complete(
            [*prompt, *sampled.token_ids],
            max_tokens=1,
            temperature=0,
            ignore_eos=True,
            echo=True,
            prompt_logprobs=1,
        ).prompt
    assert scored_grpc is not None and scored_grpc.token_ids == (*prompt, *sampled.token_ids)
    assert scored_grpc.logprobs[-1] == pytest.approx(sampled.logprobs[0], abs=1e-4)  # the gRPC client's view
    assert scored_grpc.top_logprobs[-1][0][:2] == (sampled.token_ids[0], sampled.tokens[0])
    ask = dict(
        model="tiny", max_tokens=1, temperature=0, logprobs=1, echo=True, extra_body={"ignore_eos": True}
    )
    scored = cluster.sdk().completions.create(prompt=[*prompt, *sampled.token_ids], **ask).choices[0]
    lp = scored.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + 2 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert scored.text.startswith(tiny_tokenizer().decode(prompt))
    # the echoed token after `prompt` is scored as the model scored it when it sampled it there
    assert lp.token_logprobs[len(prompt)] == pytest.approx(sampled.logprobs[0], abs=1e-4)
    # greedy: it was the most likely token, so it is its own first alternative (lm-eval's is_greedy)
    assert lp.top_logprobs[len(prompt)] == {
        lp.tokens[len(prompt)]: pytest.approx(sampled.logprobs[0], abs=1e-4)
    }


def test_a_json_schema_response_parses(cluster: Cluster):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    reply = cluster.sdk().chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    )
    assert isinstance(json.loads(reply.choices[0].message.content)["a"], int)


def test_with_tls_the_http_api_is_https_and_health_says_why_it_is_not_serving(tmp_path: Path):
    tls = CertificateAuthority.create("test CA").issue("router", tmp_path / "pki")
    argv = module_argv(
        "kvpact.router", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", *tls.flags(),
        "--startup-timeout", "60",
    )  # fmt: skip
    with running(argv, name="router", log_dir=tmp_path) as router:
        address = wait_for_line(router, r"^router http listening on (\S+)$", 15).group(1)
        trust = ssl.create_default_context(cafile=str(tls.ca))
        health = httpx.get(f"https://{address}/health", verify=trust, timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "NOT_SERVING", "state": "starting"}
        with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # no plaintext beside TLS
            httpx.get(f"http://{address}/health", timeout=5)
        sdk = openai.OpenAI(base_url=f"https://{address}/v1", api_key="x", max_retries=0,
                            http_client=httpx.Client(verify=trust))  # fmt: skip
        with pytest.raises(openai.InternalServerError) as err:  # 503: not serving yet
            sdk.models.list()
        assert err.value.status_code == 503 and "0 of 1 workers admitted" in err.value.message


def test_an_http_port_in_use_is_exit_1_naming_the_flag(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = module_argv("kvpact.router", "--listen", "127.0.0.1:0", "--http-listen", f"127.0.0.1:{port}")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"--http-listen 127.0.0.1:{port}: cannot bind" in done.stderr
    assert "router listening" not in done.stdout  # nothing started


def test_the_http_flag_is_off_by_default_and_a_bad_port_is_named(tmp_path: Path):
    from kvpact.router.cli import build_parser

    assert build_parser().parse_args([]).http_listen is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--http-listen", "nope"])
