"""kvpact.client: protobuf conversions, the status table, and the blocking Client against an in-process
router (hosted in a background loop) with a real loopback Worker server behind it."""

from dataclasses import replace

import grpc
import pytest

from kvpact.client import (
    Alternative,
    Client,
    EchoedPrompt,
    KvpactRpcError,
    Model,
    Usage,
    build_request,
    chunk_from_pb,
    completion_from_pb,
    render_cluster_status,
)
from kvpact.router.cluster_state import ClusterState
from kvpact.router.registry import WorkerEntry, WorkerState
from kvpact.router.status import cluster_status_to_pb
from kvpact.shared.features import FeatureMode, FeatureState
from kvpact.shared.handshake import StartupFailure, StartupFailureCode
from kvpact.shared.intent import Fallback, PagedAttentionMode
from kvpact.v1 import cache_pb2, generation_pb2, router_pb2
from tests.factories.eventually import eventually
from tests.router.background import BackgroundLoop
from tests.router.doubles import (
    EAGER_CPU_REASON,
    WorkerDouble,
    eager_realized,
    paged_realized,
    ready,
    registry_stub,
    running_router,
    serving_double,
    spec,
)


def test_build_request_from_text_with_every_parameter():
    request = build_request(
        "hi", model="tiny", max_tokens=7, temperature=0.0, top_p=0.9, top_k=5, min_p=0.1,
        repetition_penalty=1.1,
        seed=3, stop=("\n",), stop_token_ids=(2,), ignore_eos=True, logprobs=True,
    )  # fmt: skip
    assert request.text == "hi" and request.model == "tiny" and request.max_tokens == 7
    s = request.sampling
    assert s.HasField("temperature") and s.temperature == 0.0 and s.top_k == 5 and s.seed == 3 and s.logprobs
    assert s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1)
    assert list(request.stop) == ["\n"] and list(request.stop_token_ids) == [2] and request.ignore_eos
    more = build_request(
        "hi", min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={7: -100.0},
        logprobs=True, top_logprobs=3, echo=True, prompt_logprobs=1,
    )  # fmt: skip
    m = more.sampling
    assert more.min_tokens == 2 and more.echo and dict(m.logit_bias) == {7: -100.0}
    assert (m.presence_penalty, m.frequency_penalty, m.top_logprobs, m.prompt_logprobs) == (0.5, -0.5, 3, 1)


def test_build_request_leaves_unset_what_was_not_given():
    request = build_request([5, 6, 7])
    assert list(request.token_ids.ids) == [5, 6, 7] and request.model == ""
    assert not request.HasField("max_tokens")
    for field in ("temperature", "top_p", "repetition_penalty", "seed"):
        assert not request.sampling.HasField(field)
    assert (
        not request.echo
        and not request.sampling.HasField("prompt_logprobs")
        and not request.sampling.logit_bias
    )


def test_build_request_from_messages_and_bad_prompts():
    request = build_request(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    )
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "be brief"), ("user", "x")]
    assert build_request("x", stop="END").stop == ["END"]
    with pytest.raises(TypeError, match="prompt must be a str or a sequence of token ids"):
        build_request([1.5])


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("x", dict(top_k=-1), "top_k must be in [0, 4294967295] (0 = disabled), got -1"),
        ("x", dict(seed=-1), "seed must be in [0, 18446744073709551615], got -1"),
        ("x", dict(max_tokens=2**32), "max_tokens must be in [0, 4294967295], got 4294967296"),
        ("x", dict(stop_token_ids=[2, -1]), "stop_token_ids must be in [0, 4294967295], got [-1]"),
        ([1, -5], {}, "prompt token ids must be in [0, 4294967295], got [-5]"),
    ],
)
def test_a_value_the_wire_cannot_carry_is_invalid_argument_naming_the_field(prompt, params, message):
    """The proto's unsigned fields: protobuf itself would raise a bare ValueError naming no field."""
    with pytest.raises(KvpactRpcError) as exc:
        build_request(prompt, **params)
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT and exc.value.details == message


def test_chunk_and_completion_conversions():
    chunk = generation_pb2.GenerateChunk(
        request_id="r", text="a", token_ids=[1], logprobs=[-0.5],
        finish_reason=generation_pb2.FINISH_REASON_STOP,
        usage=generation_pb2.Usage(prompt_tokens=2, completion_tokens=1), worker_id="w",
    )  # fmt: skip
    c = chunk_from_pb(chunk)
    assert (c.text, c.token_ids, c.logprobs, c.finish_reason, c.usage, c.worker_id) == (
        "a", (1,), (-0.5,), "stop", Usage(2, 1, 0), "w",
    )  # fmt: skip
    assert chunk_from_pb(generation_pb2.GenerateChunk(text="b")).finish_reason is None
    assert chunk_from_pb(generation_pb2.GenerateChunk(text="b")).usage is None
    done = completion_from_pb(generation_pb2.CompleteResponse(text="ab", finish_reason=3))
    assert done.finish_reason == "abort" and done.text == "ab" and done.prompt is None
    named = generation_pb2.GenerateChunk(text="a", token_ids=[1], logprobs=[-0.5], tokens=["a"])
    named.top_logprobs.add(token_ids=[1, 2], logprobs=[-0.5, -1.0], tokens=["a", "b"])
    named.prompt.text, named.prompt.token_ids[:], named.prompt.tokens[:] = "xy", [3, 4], ["x", "y"]
    named.prompt.logprobs.append(-2.0)
    named.prompt.top_logprobs.add(token_ids=[5], logprobs=[-1.5], tokens=["z"])
    c = chunk_from_pb(named)
    assert c.tokens == ("a",) and c.top_logprobs == ((Alternative(1, "a", -0.5), Alternative(2, "b", -1.0)),)
    assert c.prompt == EchoedPrompt("xy", (3, 4), ("x", "y"), (-2.0,), ((Alternative(5, "z", -1.5),),))


def test_the_status_table_shows_realized_kinds_reasons_and_failures():
    entries = [
        WorkerEntry("w0", "127.0.0.1:7001", "tiny", spec("on"), None, paged_realized(), None,
                    WorkerState.ADMITTED, "realized a PAGED KV cache", last_heartbeat=9.5),
        WorkerEntry("w1", "127.0.0.1:7002", "tiny", spec("auto"), None,
                    eager_realized(Fallback("device", EAGER_CPU_REASON)), None, WorkerState.REFUSED,
                    "the cluster policy is --paged-attn on ...", last_heartbeat=9.0),
        WorkerEntry("w2", "", "tiny", spec("on"), None, None,
                    StartupFailure(StartupFailureCode.PAGED_ATTENTION_REQUIRED, "no CUDA", "device"),
                    WorkerState.FAILED, "its startup failed", last_heartbeat=9.0),
    ]  # fmt: skip
    for e in entries:
        e.capabilities = router_pb2.WorkerStatus().capabilities
    status = cluster_status_to_pb(ClusterState.SERVING, PagedAttentionMode.ON, 1, entries, now=10.0)
    table = render_cluster_status(status)
    lines = table.splitlines()
    assert lines[0] == "cluster SERVING  policy --paged-attn on  workers 1/1 admitted"
    header = [
        "WORKER", "STATE", "MODEL", "ADDRESS", "DEVICE", "ASKED", "REALIZED", "CAPACITY", "FEATURES", "LOAD",
        "HEARTBEAT",
    ]  # fmt: skip
    assert lines[1].split() == header
    assert "PAGED torch 64x16" in lines[2] and "1024 tok" in lines[2] and "0.5s ago" in lines[2]
    assert "EAGER 4 slots" in lines[3] and "REFUSED" in lines[3]
    assert f"  w1: fallback [device] {EAGER_CPU_REASON}" in lines
    assert "  w2: failed (PAGED_ATTENTION_REQUIRED) [device] no CUDA" in lines

    # Scaled up after the start: the start's --expect-workers is no longer the denominator.
    entries[1].state = WorkerState.ADMITTED
    status = cluster_status_to_pb(ClusterState.SERVING, PagedAttentionMode.ON, 1, entries, now=10.0)
    head = render_cluster_status(status).splitlines()[0]
    assert head == "cluster SERVING  policy --paged-attn on  workers 2 admitted (1 expected at start)"
    status = cluster_status_to_pb(ClusterState.STARTING, PagedAttentionMode.ON, 3, entries, now=10.0)
    assert render_cluster_status(status).splitlines()[0].endswith("workers 2/3 admitted")

    # Labels (a worker's Ray node and bundle, under kvpact-launch): a LABELS column, sorted by key.
    entries[0].labels = {"ray.node": "4b1c0e", "ray.bundle": "0"}
    status = cluster_status_to_pb(ClusterState.SERVING, PagedAttentionMode.ON, 1, entries, now=10.0)
    assert dict(status.workers[0].labels) == {"ray.node": "4b1c0e", "ray.bundle": "0"}
    lines = render_cluster_status(status).splitlines()
    assert lines[1].split() == [*header, "LABELS"]
    assert lines[2].endswith("ray.bundle=0 ray.node=4b1c0e")


def test_the_status_table_shows_each_features_state_and_the_feature_policies():
    no_cuda = FeatureState(
        "cuda-graphs", FeatureMode.AUTO, False, "no-cuda-device", "no CUDA device", "device"
    )
    realized = replace(paged_realized(), features=(FeatureState("paged-attn", FeatureMode.ON, True), no_cuda))
    entry = WorkerEntry("w0", "127.0.0.1:7001", "tiny", spec("on"), router_pb2.WorkerStatus().capabilities,
                        realized, None, WorkerState.ADMITTED, "admitted", last_heartbeat=9.5)  # fmt: skip
    policies = {"cpu-kernels": FeatureMode.OFF}
    status = cluster_status_to_pb(
        ClusterState.SERVING, PagedAttentionMode.ON, 1, [entry], now=10.0, policies=policies
    )
    on, off = cache_pb2.FEATURE_MODE_ON, cache_pb2.FEATURE_MODE_OFF
    assert dict(status.policies) == {"paged-attn": on, "cpu-kernels": off}
    lines = render_cluster_status(status).splitlines()
    assert (
        lines[0] == "cluster SERVING  policy --paged-attn on  --policy cpu-kernels=off  workers 1/1 admitted"
    )
    assert " +paged-attn !cuda-graphs " in lines[2]
    assert "  w0: cuda-graphs off [device] no-cuda-device: no CUDA device" in lines


@pytest.fixture
def cluster():
    """An in-process router with one slow-ish loopback worker "a"; yields (router target, the double)."""
    with BackgroundLoop() as bg:
        router = bg.enter(running_router(policy=PagedAttentionMode.ON))
        double = bg.enter(serving_double(WorkerDouble("a", delay_s=0.01)))

        async def register():
            async with registry_stub(router) as registry:
                assert (await registry.Register(ready("a", double.address))).admitted

        bg.run(register())
        yield f"127.0.0.1:{router.port}", double


def test_blocking_client_end_to_end(cluster):
    address, double = cluster
    with Client(address, timeout=10, metadata={"x-tenant": "t1"}) as client:
        completion = client.complete("abcd", max_tokens=3, temperature=0.0)
        assert completion.token_ids == (4, 5, 6) and completion.text == "t4 t5 t6 "
        assert completion.finish_reason == "length" and completion.usage.completion_tokens == 3
        assert completion.worker_id == "a"
        chunks = list(client.generate([9, 9], max_tokens=2))
        assert [t for c in chunks for t in c.token_ids] == [2, 3] and chunks[-1].finish_reason == "length"
        assert client.chat([{"role": "user", "content": "x"}], max_tokens=1).token_ids == (0,)
        streamed = client.chat_stream([{"role": "user", "content": "x"}], max_tokens=2)
        assert [t for c in streamed for t in c.token_ids] == [0, 1]  # chunks may merge (router/coalesce.py)
        assert client.list_models() == [Model("tiny", 256, 1)]
        status = client.cluster_status()
        assert status.state == router_pb2.CLUSTER_STATE_SERVING and status.workers[0].worker_id == "a"
        assert "cluster SERVING" in render_cluster_status(status)


def test_errors_keep_the_status_code_and_message(cluster):
    address, _ = cluster
    with Client(address, timeout=10) as client:
        with pytest.raises(KvpactRpcError) as err:
            client.complete("x", model="nope")
        assert err.value.code is grpc.StatusCode.NOT_FOUND
        assert err.value.details == "model 'nope' is not served here; served models: tiny"
        assert isinstance(err.value, grpc.RpcError)
        with pytest.raises(KvpactRpcError) as err:
            list(client.generate("x", max_tokens=1000, timeout=0.2))
        assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_breaking_out_of_a_stream_cancels_it_on_the_worker(cluster):
    address, double = cluster
    with Client(address, timeout=10) as client:
        stream = client.generate("x", max_tokens=1000)
        next(stream)
        assert double.active
        stream.close()
    eventually(lambda: not double.active, 5, "the server to see the call cancelled")
    assert double.cancelled
