"""Protobuf at the edge for what the handshake, heartbeats and ClusterStatus carry (spec, intent, realized
cache, plan, failure, load): the one place each of these types is converted to and from its message.

UNSPECIFIED enum values are read as AUTO, explicitly, and written back as AUTO.
"""

from __future__ import annotations

from dataclasses import fields

from kvpact.shared.features import FeatureIntents, FeatureMode, FeatureState, off_by_request
from kvpact.shared.fingerprint import NO_CHAT_TEMPLATE, Fingerprint
from kvpact.shared.handshake import LoadingPlan, StartupFailure, StartupFailureCode, WorkerLoad
from kvpact.shared.intent import (
    DEFAULT_BLOCK_SIZE,
    CacheDtype,
    CacheIntent,
    Fallback,
    PagedAttentionConfig,
    PagedAttentionMode,
    PagedBackend,
)
from kvpact.shared.realized import RealizedCache, realizes
from kvpact.shared.reasons import PAGED_ATTN
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.shared.spec import LayerPlacement, WorkerSpec
from kvpact.v1 import cache_pb2, worker_pb2

_MODE_TO_PB = {
    PagedAttentionMode.AUTO: cache_pb2.PAGED_ATTENTION_MODE_AUTO,
    PagedAttentionMode.ON: cache_pb2.PAGED_ATTENTION_MODE_ON,
    PagedAttentionMode.OFF: cache_pb2.PAGED_ATTENTION_MODE_OFF,
}
_MODE_FROM_PB = {v: k for k, v in _MODE_TO_PB.items()} | {
    cache_pb2.PAGED_ATTENTION_MODE_UNSPECIFIED: PagedAttentionMode.AUTO
}
_DTYPE_TO_PB = {
    CacheDtype.AUTO: cache_pb2.CACHE_DTYPE_AUTO,
    CacheDtype.FLOAT32: cache_pb2.CACHE_DTYPE_FLOAT32,
    CacheDtype.FLOAT16: cache_pb2.CACHE_DTYPE_FLOAT16,
    CacheDtype.BFLOAT16: cache_pb2.CACHE_DTYPE_BFLOAT16,
}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()} | {
    cache_pb2.CACHE_DTYPE_UNSPECIFIED: CacheDtype.AUTO
}
_BACKEND_TO_PB = {
    PagedBackend.AUTO: cache_pb2.PAGED_BACKEND_AUTO,
    PagedBackend.TRITON: cache_pb2.PAGED_BACKEND_TRITON,
    PagedBackend.TORCH: cache_pb2.PAGED_BACKEND_TORCH,
}
_BACKEND_FROM_PB = {v: k for k, v in _BACKEND_TO_PB.items()} | {
    cache_pb2.PAGED_BACKEND_UNSPECIFIED: PagedBackend.AUTO
}
_KIND_TO_PB = {CacheKind.PAGED: cache_pb2.CACHE_KIND_PAGED, CacheKind.EAGER: cache_pb2.CACHE_KIND_EAGER}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
# The scheduler follows the cache's kind (shared/scheduler_choice.py): written for older readers, never read.
_SCHEDULER_TO_PB = {
    CacheKind.PAGED: cache_pb2.SCHEDULER_KIND_PAGED,
    CacheKind.EAGER: cache_pb2.SCHEDULER_KIND_DEFAULT,
}


_FEATURE_MODE_TO_PB = {
    FeatureMode.AUTO: cache_pb2.FEATURE_MODE_AUTO,
    FeatureMode.ON: cache_pb2.FEATURE_MODE_ON,
    FeatureMode.OFF: cache_pb2.FEATURE_MODE_OFF,
}
_FEATURE_MODE_FROM_PB = {v: k for k, v in _FEATURE_MODE_TO_PB.items()} | {
    cache_pb2.FEATURE_MODE_UNSPECIFIED: FeatureMode.AUTO
}


def feature_mode_to_pb(mode: FeatureMode) -> cache_pb2.FeatureMode.ValueType:
    return _FEATURE_MODE_TO_PB[mode]


def feature_mode_from_pb(value: int) -> FeatureMode:
    return _FEATURE_MODE_FROM_PB[value]  # type: ignore[index]


def feature_to_pb(state: FeatureState) -> cache_pb2.FeatureState:
    return cache_pb2.FeatureState(
        name=state.name,
        requested=_FEATURE_MODE_TO_PB[state.requested],
        realized=state.realized,
        reason_code=state.code,
        message=state.message,
        component=state.component,
    )


def feature_from_pb(msg: cache_pb2.FeatureState) -> FeatureState:
    return FeatureState(
        name=msg.name,
        requested=feature_mode_from_pb(msg.requested),
        realized=msg.realized,
        code=msg.reason_code,
        message=msg.message,
        component=msg.component,
    )


def _fallbacks_to_pb(fallbacks: tuple[Fallback, ...]) -> list[cache_pb2.Fallback]:
    return [cache_pb2.Fallback(component=f.component, reason=f.reason, code=f.code) for f in fallbacks]


def _features_from_pb(msgs: object, kind: int, fallbacks: object) -> tuple[FeatureState, ...]:
    """The features as sent. A sender older than `features` reports paged-attn only as a cache kind and
    its fallbacks (which the wire still carries, derived, for older readers): read those as paged-attn's
    state, requested auto unless nothing fell back from an eager cache (off). Raises KeyError for neither."""
    states = tuple(feature_from_pb(f) for f in msgs)  # type: ignore[attr-defined]
    if any(s.name == PAGED_ATTN for s in states):
        return states
    first = next(iter(fallbacks), None)  # type: ignore[call-overload]
    if _KIND_FROM_PB[kind] is CacheKind.PAGED:  # type: ignore[index]
        paged = FeatureState(PAGED_ATTN, FeatureMode.AUTO, True)
    elif first is not None:
        paged = FeatureState(PAGED_ATTN, FeatureMode.AUTO, False, first.code, first.reason, first.component)
    else:
        paged = off_by_request(PAGED_ATTN)
    return (paged, *states)


def mode_to_pb(mode: PagedAttentionMode) -> cache_pb2.PagedAttentionMode.ValueType:
    return _MODE_TO_PB[mode]


def mode_from_pb(value: int) -> PagedAttentionMode:
    return _MODE_FROM_PB[value]  # type: ignore[index]


def paged_config_to_pb(config: PagedAttentionConfig, required: bool) -> cache_pb2.PagedAttentionConfig:
    """`required`: the mode's (on), written for older readers; a reader takes the mode."""
    msg = cache_pb2.PagedAttentionConfig(
        required=required,
        block_size=config.block_size,
        cache_dtype=_DTYPE_TO_PB[config.cache_dtype],
        backend=_BACKEND_TO_PB[config.backend],
    )
    if config.memory_fraction is not None:
        msg.memory_fraction = config.memory_fraction
    elif config.memory_bytes is not None:
        msg.memory_bytes = config.memory_bytes
    elif config.context_tokens is not None:
        msg.context_tokens = config.context_tokens
    return msg


def paged_config_from_pb(msg: cache_pb2.PagedAttentionConfig) -> PagedAttentionConfig:
    budget = msg.WhichOneof("budget")
    return PagedAttentionConfig(
        block_size=msg.block_size or DEFAULT_BLOCK_SIZE,
        memory_fraction=msg.memory_fraction if budget == "memory_fraction" else None,
        memory_bytes=msg.memory_bytes if budget == "memory_bytes" else None,
        context_tokens=msg.context_tokens if budget == "context_tokens" else None,
        cache_dtype=_DTYPE_FROM_PB[msg.cache_dtype],
        backend=_BACKEND_FROM_PB[msg.backend],
    )


def intent_to_pb(intent: CacheIntent) -> cache_pb2.CacheIntent:
    msg = cache_pb2.CacheIntent(mode=_MODE_TO_PB[intent.mode])
    if intent.paged is not None:
        msg.paged.CopyFrom(paged_config_to_pb(intent.paged, intent.required))
    return msg


def intent_from_pb(msg: cache_pb2.CacheIntent) -> CacheIntent:
    """UNSPECIFIED reads as AUTO. A message without `paged` under auto/on gets the default config;
    `required` always follows the mode (the mode is what the operator said)."""
    mode = mode_from_pb(msg.mode)
    if mode is PagedAttentionMode.OFF:
        return CacheIntent(mode=mode, paged=None)
    config = paged_config_from_pb(msg.paged) if msg.HasField("paged") else PagedAttentionConfig()
    return CacheIntent(mode=mode, paged=config)


def realized_to_pb(realized: RealizedCache) -> cache_pb2.RealizedCache:
    return cache_pb2.RealizedCache(
        kind=_KIND_TO_PB[realized.kind],
        backend=_BACKEND_TO_PB[realized.backend] if realized.backend else cache_pb2.PAGED_BACKEND_UNSPECIFIED,
        block_size=realized.block_size,
        num_blocks=realized.num_blocks,
        capacity_tokens=realized.capacity_tokens,
        max_concurrency=realized.max_concurrency,
        scheduler=_SCHEDULER_TO_PB[realized.kind],
        fallbacks=_fallbacks_to_pb(realized.fallbacks),  # derived from features["paged-attn"], as kind
        cache_dtype=_DTYPE_TO_PB[realized.cache_dtype],
        max_model_len=realized.max_model_len,
        memory_bytes=realized.memory_bytes,
        features=[feature_to_pb(f) for f in realized.features],
        tensor_parallel_size=realized.tensor_parallel_size,
        rank_devices=list(realized.rank_devices),
    )


def realized_from_pb(msg: cache_pb2.RealizedCache) -> RealizedCache:
    """Raises KeyError for a cache with neither paged-attn's state nor a kind."""
    features = _features_from_pb(msg.features, msg.kind, msg.fallbacks)
    paged = realizes(features, PAGED_ATTN)
    return RealizedCache(
        max_model_len=msg.max_model_len,
        capacity_tokens=msg.capacity_tokens,
        max_concurrency=msg.max_concurrency,
        num_blocks=msg.num_blocks,
        memory_bytes=msg.memory_bytes,
        cache_dtype=_DTYPE_FROM_PB[msg.cache_dtype],
        backend=_BACKEND_FROM_PB[msg.backend] if paged else None,
        block_size=msg.block_size,
        features=features,
        tensor_parallel_size=msg.tensor_parallel_size or 1,
        rank_devices=tuple(msg.rank_devices),
    )


def plan_to_pb(plan: LoadingPlan) -> worker_pb2.LoadingPlan:
    return worker_pb2.LoadingPlan(
        planned_kind=_KIND_TO_PB[plan.kind],
        planned_backend=_BACKEND_TO_PB[plan.backend] if plan.backend else cache_pb2.PAGED_BACKEND_UNSPECIFIED,
        fallbacks=_fallbacks_to_pb(plan.fallbacks),
        verdict_seconds=plan.verdict_seconds,
        features=[feature_to_pb(f) for f in plan.features],
    )


def plan_from_pb(msg: worker_pb2.LoadingPlan) -> LoadingPlan:
    """Raises KeyError for a plan with neither paged-attn's state nor a kind."""
    features = _features_from_pb(msg.features, msg.planned_kind, msg.fallbacks)
    paged = realizes(features, PAGED_ATTN)
    return LoadingPlan(
        features=features,
        backend=_BACKEND_FROM_PB[msg.planned_backend] if paged else None,
        verdict_seconds=msg.verdict_seconds,
    )


# WorkerSpec's plain fields travel under their own names; a zero value read back means the field's
# default (an older sender's "unset"); an `optional` proto field unset reads as None.
_SPEC_SCALARS = tuple(f.name for f in fields(WorkerSpec) if f.name not in ("device_map", "cache", "features"))


def spec_to_pb(spec: WorkerSpec) -> worker_pb2.WorkerSpec:
    msg = worker_pb2.WorkerSpec(
        device_map=[
            worker_pb2.LayerPlacement(device=p.device, num_layers=p.num_layers) for p in spec.device_map
        ],
        cache=intent_to_pb(spec.cache),
        features={n: _FEATURE_MODE_TO_PB[spec.features.mode(n)] for n in FeatureIntents.names()},
    )
    for name in _SPEC_SCALARS:
        if (value := getattr(spec, name)) is not None:
            setattr(msg, name, value)
    return msg


def spec_from_pb(msg: worker_pb2.WorkerSpec) -> WorkerSpec:
    scalars = {f.name: value for f, value in msg.ListFields() if f.name in _SPEC_SCALARS}  # the set ones
    return WorkerSpec(
        device_map=tuple(LayerPlacement(device=p.device, num_layers=p.num_layers) for p in msg.device_map),
        cache=intent_from_pb(msg.cache),
        features=features_from_pb(msg.features),
        **scalars,
    )


def features_from_pb(modes: object) -> FeatureIntents:
    """WorkerSpec.features (name -> mode); a feature absent reads as AUTO. An unknown name is a sender
    newer than this reader: ignored here (the sender's handshake still reports its state)."""
    known = set(FeatureIntents.names())
    values = {n.replace("-", "_"): feature_mode_from_pb(m) for n, m in modes.items() if n in known}  # type: ignore[attr-defined]
    return FeatureIntents(**values)


def fingerprint_to_pb(fingerprint: Fingerprint) -> worker_pb2.Fingerprint:
    return worker_pb2.Fingerprint(
        model=fingerprint.model,
        tokenizer=fingerprint.tokenizer,
        chat_template=fingerprint.chat_template,
        max_model_len=fingerprint.max_model_len,
        block_size=fingerprint.block_size,
        tensor_parallel_size=fingerprint.tensor_parallel_size,
        dtype=fingerprint.dtype,
        cache_dtype=fingerprint.cache_dtype,
    )


def fingerprint_from_pb(msg: worker_pb2.Fingerprint) -> Fingerprint:
    """An empty chat_template reads as "none"; tensor_parallel_size 0 as 1 (as WorkerSpec's)."""
    return Fingerprint(
        model=msg.model,
        tokenizer=msg.tokenizer,
        chat_template=msg.chat_template or NO_CHAT_TEMPLATE,
        max_model_len=msg.max_model_len,
        block_size=msg.block_size,
        tensor_parallel_size=msg.tensor_parallel_size or 1,
        dtype=msg.dtype,
        cache_dtype=msg.cache_dtype,
    )


_FAILURE_TO_PB = {
    StartupFailureCode.PAGED_ATTENTION_REQUIRED: worker_pb2.STARTUP_FAILURE_CODE_PAGED_ATTENTION_REQUIRED,
    StartupFailureCode.INVALID_CONFIG: worker_pb2.STARTUP_FAILURE_CODE_INVALID_CONFIG,
    StartupFailureCode.MODEL_LOAD: worker_pb2.STARTUP_FAILURE_CODE_MODEL_LOAD,
    StartupFailureCode.OUT_OF_MEMORY: worker_pb2.STARTUP_FAILURE_CODE_OUT_OF_MEMORY,
    StartupFailureCode.INTERNAL: worker_pb2.STARTUP_FAILURE_CODE_INTERNAL,
    StartupFailureCode.FEATURE_REQUIRED: worker_pb2.STARTUP_FAILURE_CODE_FEATURE_REQUIRED,
}
# An unspecified code is an unexplained failure: INTERNAL, never a guess at a policy failure.
_FAILURE_FROM_PB = {v: k for k, v in _FAILURE_TO_PB.items()} | {
    worker_pb2.STARTUP_FAILURE_CODE_UNSPECIFIED: StartupFailureCode.INTERNAL
}


def failure_to_pb(failure: StartupFailure) -> worker_pb2.StartupFailure:
    return worker_pb2.StartupFailure(
        code=_FAILURE_TO_PB[failure.code],
        reason=failure.reason,
        component=failure.component,
        feature=failure.feature,
    )


def failure_from_pb(msg: worker_pb2.StartupFailure) -> StartupFailure:
    return StartupFailure(
        code=_FAILURE_FROM_PB[msg.code], reason=msg.reason, component=msg.component, feature=msg.feature
    )


def load_to_pb(load: WorkerLoad) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        tokens_per_second=load.tokens_per_second,
        num_preemptions=load.num_preemptions,
        kernel_compiles_after_ready=load.kernel_compiles_after_ready,
        eager_steps_under_graphs=load.eager_steps_under_graphs,
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
    )


def load_from_pb(msg: worker_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        num_running=msg.num_running,
        num_waiting=msg.num_waiting,
        num_free_blocks=msg.num_free_blocks,
        num_total_blocks=msg.num_total_blocks,
        tokens_per_second=msg.tokens_per_second,
        num_preemptions=msg.num_preemptions,
        kernel_compiles_after_ready=msg.kernel_compiles_after_ready,
        eager_steps_under_graphs=msg.eager_steps_under_graphs,
        prefix_cache_queries=msg.prefix_cache_queries,
        prefix_cache_hits=msg.prefix_cache_hits,
    )
