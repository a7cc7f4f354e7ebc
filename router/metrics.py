"""Prometheus metrics, served on --metrics-port (prometheus-client's HTTP server).

Worker gauges are computed from the registry at scrape time, so they never drift from it:

    kvpact_router_cluster_state{state}                 1 for the current state
    kvpact_router_workers{state,realized_kind}         workers by state and realized KV cache kind
    kvpact_router_worker_realized{worker_id,model,realized_kind,backend}   1 per registered worker
    kvpact_router_worker_outstanding{worker_id}        requests being forwarded to it
    kvpact_router_worker_free_blocks{worker_id}        from its last heartbeat
    kvpact_worker_feature_realized{feature,requested,realized}   workers by each feature's intent and outcome
    kvpact_worker_fallbacks_total{feature,reason}      features realized off although asked auto (or on),
                                                       counted once per worker registration that reports it
    kvpact_worker_drift_total{feature,reason}          a serving worker's heartbeat showed a feature lost (or
                                                       a counter grew: router/drift.py), once per change
    kvpact_router_requests_total{model,code,api}           finished client requests by gRPC status
    kvpact_router_tokens_total{model,api}                  generated tokens relayed
    kvpact_router_time_to_first_token_seconds{model,api}   received -> first token relayed (as clients see it)
    kvpact_router_inter_token_latency_seconds{model,api}   between two relayed chunks with tokens, per token
    kvpact_router_request_duration_seconds{model,api}      request received -> its stream ended

`api` is the front the request came in on: "grpc" (the Generation service) or "http" (the OpenAI-compatible
HTTP front, router/http/). An HTTP request's code is the gRPC status it maps from (docs/openai.md).

Each router owns its own CollectorRegistry (no module-level state).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter as Tally
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpact.router.cluster_state import ClusterState, Startup
from kvpact.router.drift import Drift
from kvpact.router.registry import Registry
from kvpact.shared.features import FeatureState

NO_CACHE = "none"  # a worker that failed before building a cache
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self, registry: Registry, startup: Startup) -> None:
        self.prometheus = CollectorRegistry()
        self.prometheus.register(_ClusterCollector(registry, startup))
        self.fallbacks = Counter(
            "kvpact_worker_fallbacks",
            "Features that workers realized off although not asked off, by feature and reason code",
            ["feature", "reason"],
            registry=self.prometheus,
        )
        self.drift = Counter(
            "kvpact_worker_drift",
            "Drift while serving: a feature a serving worker lost (or a counter that grew), by reason code",
            ["feature", "reason"],
            registry=self.prometheus,
        )
        self.requests = Counter(
            "kvpact_router_requests",
            "Finished client requests by gRPC status code",
            ["model", "code", "api"],
            registry=self.prometheus,
        )
        self.tokens = Counter(
            "kvpact_router_tokens",
            "Generated tokens relayed to clients",
            ["model", "api"],
            registry=self.prometheus,
        )

        self.ttft = Histogram(
            "kvpact_router_time_to_first_token_seconds",
            "Request received to its first token relayed, as clients see it",
            ["model", "api"],
            buckets=TTFT_BUCKETS,
            registry=self.prometheus,
        )
        self.itl = WeightedHistogram(
            "kvpact_router_inter_token_latency_seconds",
            "Time between relayed tokens of one request (a chunk's gap over its tokens)",
            ["model", "api"],
            ITL_BUCKETS,
        )
        self.prometheus.register(self.itl)
        self.duration = Histogram(
            "kvpact_router_request_duration_seconds",
            "Request received to its stream ended",
            ["model", "api"],
            buckets=E2E_BUCKETS,
            registry=self.prometheus,
        )

    def stream(self, model: str, api: str = "grpc") -> StreamObserver:
        """One relayed request's chunk timings (its histogram children looked up once, not per chunk)."""
        return StreamObserver(self, model, api)

    def observe_duration(self, model: str, seconds: float, api: str = "grpc") -> None:
        self.duration.labels(model=model, api=api).observe(seconds)

    def observe_request(self, model: str, code: str, num_tokens: int, api: str = "grpc") -> None:
        self.requests.labels(model=model, code=code, api=api).inc()
        if num_tokens:
            self.tokens.labels(model=model, api=api).inc(num_tokens)

    def observe_fallbacks(self, features: tuple[FeatureState, ...]) -> None:
        """One worker registration's features: count each that fell back."""
        for f in features:
            if f.fell_back:
                self.fallbacks.labels(feature=f.name, reason=f.code or "unknown").inc()

    def observe_drift(self, drift: Drift) -> None:
        self.drift.labels(feature=drift.feature, reason=drift.reason).inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.prometheus)


class StreamObserver:
    __slots__ = ("_metrics", "_model", "_api", "_itl")

    def __init__(self, metrics: RouterMetrics, model: str, api: str) -> None:
        self._metrics, self._model, self._api = metrics, model, api
        self._itl: WeightedCounts | None = None

    def chunk(self, seconds_since_previous: float, num_tokens: int, first: bool) -> None:
        """A relayed chunk with tokens: its gap from the request's start (first) or from the previous one."""
        if first:
            self._metrics.ttft.labels(model=self._model, api=self._api).observe(seconds_since_previous)
        elif num_tokens:
            itl = self._itl
            if itl is None:
                itl = self._itl = self._metrics.itl.labels(self._model, self._api)
            itl.observe(seconds_since_previous / num_tokens, num_tokens)


class WeightedCounts:
    """One label set's buckets (not cumulative; the last is +Inf) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float, weight: int) -> None:
        """`weight` observations of `value`, in one step."""
        self.counts[bisect.bisect_left(self.bounds, value)] += weight
        self.sum += value * weight


class WeightedHistogram(Collector):
    """A Prometheus histogram that takes n equal observations at once: a merged chunk of n tokens is n
    inter-token gaps of its gap / n, one update (prometheus_client's Histogram takes one observation a
    call, about 2 µs each, which a per-token loop paid for every token of a merged chunk). Updated on the
    event loop only; a scrape (the metrics server's thread) reads a copy, so its sum may trail its
    buckets by the update in progress."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]):
        self._name, self._documentation, self._labelnames = name, documentation, list(labelnames)
        self._bounds = [*buckets, math.inf]
        self._children: dict[tuple[str, ...], WeightedCounts] = {}

    def labels(self, *values: str) -> WeightedCounts:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = WeightedCounts(self._bounds)
        return child

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            counts, total, cumulative = list(child.counts), child.sum, 0
            buckets = []
            for bound, count in zip(self._bounds, counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
            family.add_metric(list(values), buckets, total)
        yield family


class _ClusterCollector(Collector):
    def __init__(self, registry: Registry, startup: Startup) -> None:
        self._registry = registry
        self._startup = startup

    def collect(self) -> Iterator[Metric]:
        entries = self._registry.entries()
        state = GaugeMetricFamily(
            "kvpact_router_cluster_state", "1 for the cluster's current state", labels=["state"]
        )
        for cluster_state in ClusterState:
            state.add_metric([cluster_state.value], 1.0 if self._startup.state is cluster_state else 0.0)
        yield state

        by_state = Tally((e.state.value, e.realized.kind.value if e.realized else NO_CACHE) for e in entries)
        workers = GaugeMetricFamily(
            "kvpact_router_workers",
            "Workers by state and realized KV cache kind",
            labels=["state", "realized_kind"],
        )
        for (worker_state, kind), n in sorted(by_state.items()):
            workers.add_metric([worker_state, kind], n)
        yield workers

        realized = GaugeMetricFamily(
            "kvpact_router_worker_realized",
            "1 per worker, labeled with what it built",
            labels=["worker_id", "model", "realized_kind", "backend"],
        )
        outstanding = GaugeMetricFamily(
            "kvpact_router_worker_outstanding", "Requests being forwarded to it", labels=["worker_id"]
        )
        free = GaugeMetricFamily(
            "kvpact_router_worker_free_blocks",
            "Free KV blocks (EAGER: slots) at its last heartbeat",
            labels=["worker_id"],
        )
        for e in entries:
            kind = e.realized.kind.value if e.realized else NO_CACHE
            backend = e.realized.backend.value if e.realized and e.realized.backend else ""
            realized.add_metric([e.worker_id, e.model_name, kind, backend], 1.0)
            outstanding.add_metric([e.worker_id], e.num_outstanding)
            free.add_metric([e.worker_id], e.load.num_free_blocks)
        yield realized
        yield outstanding
        yield free

        features = GaugeMetricFamily(
            "kvpact_worker_feature_realized",
            "Workers by feature, its requested mode and whether it is realized (as its latest heartbeat "
            "says, else as built, else planned)",
            labels=["feature", "requested", "realized"],
        )
        tally = Tally(
            (f.name, f.requested.value, "on" if f.realized else "off") for e in entries for f in e.features
        )
        for (name, requested, on), n in sorted(tally.items()):
            features.add_metric([name, requested, on], n)
        yield features
