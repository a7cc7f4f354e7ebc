"""Protobuf at the edge: every intent, budget and realized cache survives the round trip."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpact.shared.describe import realized_table
from kvpact.shared.features import FeatureIntents, FeatureMode, FeatureState, off_by_request
from kvpact.shared.handshake import LoadingPlan
from kvpact.shared.handshake_pb import (
    intent_from_pb,
    intent_to_pb,
    mode_from_pb,
    plan_from_pb,
    plan_to_pb,
    realized_from_pb,
    realized_to_pb,
    spec_from_pb,
    spec_to_pb,
)
from kvpact.shared.intent import (
    CacheDtype,
    CacheIntent,
    PagedAttentionConfig,
    PagedAttentionMode,
    PagedBackend,
    cache_intent,
)
from kvpact.shared.realized import RealizedCache
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.shared.spec import LayerPlacement, WorkerSpec, parse_device_map
from kvpact.v1 import cache_pb2, worker_pb2

budgets = st.one_of(
    st.just({}),
    st.floats(min_value=0.01, max_value=1.0).map(lambda f: {"memory_fraction": f}),
    st.integers(min_value=1, max_value=2**62).map(lambda b: {"memory_bytes": b}),
    st.integers(min_value=1, max_value=2**40).map(lambda t: {"context_tokens": t}),
)
settings = st.builds(
    lambda budget, block, dtype, backend: PagedAttentionConfig(
        block_size=block, cache_dtype=dtype, backend=backend, **budget
    ),
    budgets,
    st.sampled_from([1, 8, 16, 32, 128]),
    st.sampled_from(list(CacheDtype)),
    st.sampled_from(list(PagedBackend)),
)
feature_intents = st.builds(
    FeatureIntents, *(st.sampled_from(list(FeatureMode)) for _ in FeatureIntents.names())
)
intents = st.builds(
    cache_intent,
    st.sampled_from(list(PagedAttentionMode)),
    settings,
)


@given(intents)
def test_intent_round_trip_for_every_mode_and_budget(intent: CacheIntent):
    assert intent_from_pb(intent_to_pb(intent)) == intent


@given(intents, st.text(max_size=20), st.sampled_from(["auto", "cpu", "cuda:1"]), feature_intents)
def test_worker_spec_round_trip(intent, model, device, features):
    spec = WorkerSpec(
        model=model,
        device=device,
        device_map=(LayerPlacement("cuda:0", 20), LayerPlacement("cpu", 10)),
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        cache=intent,
        features=features,
    )
    assert spec_from_pb(spec_to_pb(spec)) == spec


def test_every_worker_spec_field_travels():
    """A field added to WorkerSpec but not to worker.proto's WorkerSpec would be dropped on the wire."""
    off_default = {
        "model": "/models/x",
        "device": "cuda:1",
        "device_map": (LayerPlacement("cuda:0", 2),),
        "dtype": "float16",
        "max_model_len": 100,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 64,
        "threads": 1,
        "tensor_parallel_size": 3,
        "prompt_tokens_beside_decodes": 16,
        "cache": cache_intent(PagedAttentionMode.ON),
        "max_model_len_auto": True,
        "features": FeatureIntents(prefix_caching=FeatureMode.OFF),
    }
    names = {f.name for f in dataclasses.fields(WorkerSpec)}
    assert names == set(off_default), "give the new field a value off its default here"
    assert names <= set(worker_pb2.WorkerSpec.DESCRIPTOR.fields_by_name)
    spec = WorkerSpec(**off_default)
    assert all(getattr(spec, n) != getattr(WorkerSpec(), n) for n in names)
    assert spec_from_pb(spec_to_pb(spec)) == spec
    assert spec_from_pb(worker_pb2.WorkerSpec()) == WorkerSpec()  # zero values read as the defaults


def test_unspecified_mode_is_read_as_auto_and_written_back_as_auto():
    assert mode_from_pb(cache_pb2.PAGED_ATTENTION_MODE_UNSPECIFIED) is PagedAttentionMode.AUTO
    intent = intent_from_pb(cache_pb2.CacheIntent())
    assert intent == CacheIntent(mode=PagedAttentionMode.AUTO, paged=PagedAttentionConfig())
    assert intent_to_pb(intent).mode == cache_pb2.PAGED_ATTENTION_MODE_AUTO


def test_unset_block_size_reads_as_the_default():
    msg = cache_pb2.CacheIntent(mode=cache_pb2.PAGED_ATTENTION_MODE_ON)
    msg.paged.context_tokens = 4096
    expected = PagedAttentionConfig(block_size=16, context_tokens=4096)
    assert intent_from_pb(msg).paged == expected and intent_from_pb(msg).required


def test_on_without_paged_message_is_still_required():
    intent = intent_from_pb(cache_pb2.CacheIntent(mode=cache_pb2.PAGED_ATTENTION_MODE_ON))
    assert intent.paged == PagedAttentionConfig() and intent.required
    # the wire's PagedAttentionConfig.required follows the mode, for older readers; a reader takes the mode
    assert [
        intent_to_pb(cache_intent(m)).paged.required for m in (PagedAttentionMode.AUTO, PagedAttentionMode.ON)
    ] == [
        False,
        True,
    ]
    stale = cache_pb2.CacheIntent(
        mode=cache_pb2.PAGED_ATTENTION_MODE_AUTO, paged=cache_pb2.PagedAttentionConfig(required=True)
    )
    assert not intent_from_pb(stale).required


# paged-attn's state: realized, fell back under auto (the door takes at most one fallback), or off.
paged_attn_states = st.one_of(
    st.just(FeatureState("paged-attn", FeatureMode.ON, True)),
    st.builds(
        lambda c, r: FeatureState("paged-attn", FeatureMode.AUTO, False, "dtype", r, c),
        st.sampled_from(["device", "loader", "cache-budget"]),
        st.text(max_size=40),
    ),
    st.just(off_by_request("paged-attn")),
)


@given(paged_attn_states)
def test_realized_cache_round_trip(paged_attn):
    paged = paged_attn.realized
    realized = RealizedCache(
        max_model_len=2048,
        capacity_tokens=65536,
        max_concurrency=32,
        num_blocks=4096,
        memory_bytes=3 << 30,
        cache_dtype=CacheDtype.FLOAT32,
        backend=PagedBackend.TORCH if paged else None,
        block_size=16 if paged else 0,
        features=(
            paged_attn,
            FeatureState("cuda-graphs", FeatureMode.ON, False, "no-cuda-device", "no CUDA device", "device"),
        ),
        tensor_parallel_size=2,
        rank_devices=("cuda:0", "cuda:1"),
    )
    msg = realized_to_pb(realized)
    assert realized_from_pb(msg) == realized
    # what an older reader reads: the kind, the scheduler that follows it, and paged-attn's fallback
    kind, scheduler = (1, 1) if paged else (2, 2)  # CACHE_KIND_PAGED/EAGER, SCHEDULER_KIND_PAGED/DEFAULT
    assert (msg.kind, msg.scheduler) == (kind, scheduler)
    assert [(f.component, f.reason) for f in msg.fallbacks] == (
        [(paged_attn.component, paged_attn.message)] if paged_attn.fell_back else []
    )


@pytest.mark.parametrize(
    ("kind", "fallbacks", "realized", "code"),
    [
        (cache_pb2.CACHE_KIND_PAGED, [], True, ""),
        (
            cache_pb2.CACHE_KIND_EAGER,
            [cache_pb2.Fallback(component="device", reason="eager", code="x")],
            False,
            "x",
        ),
        (cache_pb2.CACHE_KIND_EAGER, [], False, "off-by-request"),
    ],
)
def test_paged_attn_from_a_sender_older_than_features_reads_from_its_kind_and_fallback(
    kind, fallbacks, realized, code
):
    msg = cache_pb2.RealizedCache(kind=kind, fallbacks=fallbacks, max_model_len=256)
    state = realized_from_pb(msg).feature("paged-attn")
    assert state is not None and (state.realized, state.code) == (realized, code)
    plan = plan_from_pb(worker_pb2.LoadingPlan(planned_kind=kind, fallbacks=fallbacks))
    assert plan.kind is realized_from_pb(msg).kind is (CacheKind.PAGED if realized else CacheKind.EAGER)
    with pytest.raises(KeyError):  # neither a kind nor paged-attn's state
        realized_from_pb(cache_pb2.RealizedCache(max_model_len=256))


def test_a_realized_cache_needs_paged_attn_state():
    with pytest.raises(ValueError, match="paged-attn's state"):
        RealizedCache(256, 256, 1, 1, 0, CacheDtype.FLOAT32, features=())


def test_a_realized_cache_from_an_older_worker_has_one_rank():
    msg = realized_to_pb(
        RealizedCache(256, 256, 1, 1, 0, CacheDtype.FLOAT32, (off_by_request("paged-attn"),))
    )
    msg.ClearField("tensor_parallel_size")
    assert realized_from_pb(msg).tensor_parallel_size == 1


def test_realized_table_names_kind_and_fallback():
    table = realized_table(
        RealizedCache(
            max_model_len=2048,
            capacity_tokens=16384,
            max_concurrency=8,
            num_blocks=8,
            memory_bytes=1 << 30,
            cache_dtype=CacheDtype.FLOAT32,
            features=(
                FeatureState("paged-attn", FeatureMode.AUTO, False, "", "eager is the CPU default", "device"),
            ),
        )
    )
    assert "EAGER" in table and "fallback (device)  eager is the CPU default" in table


def test_device_map_parsing():
    assert parse_device_map("cuda:0=20,cpu=10") == (LayerPlacement("cuda:0", 20), LayerPlacement("cpu", 10))
    with pytest.raises(ValueError, match="--device-map"):
        parse_device_map("cuda:0")


@given(
    paged_attn_states,
    st.sampled_from([PagedBackend.TORCH, PagedBackend.TRITON]),
    st.floats(min_value=0, max_value=100, allow_nan=False),
)
def test_loading_plan_round_trip(paged_attn, backend, seconds):
    plan = LoadingPlan(
        features=(
            paged_attn,
            FeatureState("prefix-caching", FeatureMode.OFF, False, "off-by-request", "off", "intent"),
        ),
        backend=backend if paged_attn.realized else None,
        verdict_seconds=seconds,
    )
    assert plan_from_pb(plan_to_pb(plan)) == plan


def test_the_fingerprint_round_trips_and_an_unset_one_reads_as_its_defaults():
    from kvpact.shared.fingerprint import Fingerprint
    from kvpact.shared.handshake_pb import fingerprint_from_pb, fingerprint_to_pb

    digests = ("sha256:" + "a" * 64, "sha256:" + "b" * 64, "none")
    fingerprint = Fingerprint(*digests, 4096, 16, 2, dtype="bfloat16", cache_dtype="float16")
    assert fingerprint_from_pb(fingerprint_to_pb(fingerprint)) == fingerprint
    assert Fingerprint.from_json(fingerprint.to_json()) == fingerprint
    empty = fingerprint_from_pb(worker_pb2.Fingerprint())
    assert (empty.chat_template, empty.tensor_parallel_size, empty.block_size) == ("none", 1, 0)
    assert empty.shown("dtype") == "not reported (a worker older than this router)"
