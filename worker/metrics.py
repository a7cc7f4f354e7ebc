"""A worker's Prometheus metrics, served on `worker --metrics-port` (prometheus-client's HTTP server, on
the --listen host; port 0 picks a free one, printed as "worker ID metrics on http://HOST:PORT/metrics").

Read from the engine at scrape time (never drift from it):

    kvpact_worker_requests_running / _waiting           sequences in the engine after its last step
    kvpact_worker_kv_usage_ratio                        used / total KV blocks (EAGER: slots), 0..1
    kvpact_worker_kv_free_blocks / _kv_total_blocks     blocks (EAGER: slots)
    kvpact_worker_preemptions_total                     sequences preempted (recomputed) so far
    kvpact_worker_state{state}                          1 for loading | serving | stopping
    kvpact_worker_paged_attention{requested,realized_kind,backend}   1: the contract, as realized
    kvpact_worker_info{worker_id,model}                 1

Recorded from the engine's per-request events (worker/engine/engine_observer.py; O(1) per token):

    kvpact_worker_time_to_first_token_seconds           arrival -> first generated token
    kvpact_worker_inter_token_latency_seconds           between two tokens of one request
    kvpact_worker_request_duration_seconds              arrival -> finished (end to end)
    kvpact_worker_request_queue_seconds                 arrival -> first scheduled
    kvpact_worker_requests_total{outcome}               stop | length | abort | error | rejected
    kvpact_worker_prompt_tokens_total / _generation_tokens_total
    kvpact_worker_prefix_cache_queries_total / _hits_total   prompt tokens looked up / served from cache
    kvpact_worker_paged_attention_fallbacks_total{component} every fallback taken at startup

Each worker owns its own CollectorRegistry (no module-level state).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpact.shared.intent import PagedAttentionMode
from kvpact.shared.realized import RealizedCache
from kvpact.worker.engine.engine_observer import OUTCOMES, FinishedRequest

if TYPE_CHECKING:
    from kvpact.worker.engine.engine import Engine

# Seconds. TTFT and end-to-end span a CPU prefill of long prompts; inter-token spans a GPU decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
WORKER_STATES = ("loading", "serving", "stopping")


class WorkerMetrics:
    """The engine's observer and the scrape-time view of one worker."""

    def __init__(self, worker_id: str, requested: PagedAttentionMode) -> None:
        self.registry = CollectorRegistry()
        self._view = _EngineCollector(worker_id, requested)
        self.registry.register(self._view)
        self.ttft = Histogram(
            "kvpact_worker_time_to_first_token_seconds",
            "Arrival to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvpact_worker_inter_token_latency_seconds",
            "Time between two generated tokens of one request",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvpact_worker_request_duration_seconds",
            "Arrival to finished, end to end",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "kvpact_worker_request_queue_seconds",
            "Arrival to first scheduled",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "kvpact_worker_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.prompt_tokens = Counter(
            "kvpact_worker_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "kvpact_worker_generation_tokens", "Generated tokens of finished requests", registry=self.registry
        )
        self.prefix_queries = Counter(
            "kvpact_worker_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (PAGED with prefix caching)",
            registry=self.registry,
        )
        self.prefix_hits = Counter(
            "kvpact_worker_prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "kvpact_worker_paged_attention_fallbacks",
            "PagedAttention fallbacks taken at startup, by component",
            ["component"],
            registry=self.registry,
        )
        self._prefix_caching = False
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP server; returns the bound port (port 0 = a free one). OSError if it cannot bind."""
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def attach(self, engine: Engine, model_name: str) -> None:
        """The engine is built: record its fallbacks, start observing its requests."""
        realized = engine.realized
        self._prefix_caching = realized.prefix_caching
        for fallback in realized.fallbacks:
            self.fallbacks.labels(component=fallback.component).inc()
        self._view.attach(engine, realized, model_name)
        engine.step_loop.observer = self

    def set_state(self, state: str) -> None:
        self._view.state = state

    # -- EngineObserver ----------------------------------------------------------------------------

    def request_rejected(self) -> None:
        self.requests.labels(outcome="rejected").inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def request_finished(self, request: FinishedRequest) -> None:
        self.requests.labels(outcome=request.outcome).inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(request.num_generated_tokens)
        self.duration.observe(request.duration_s)
        if request.queued_s is not None:
            self.queue.observe(request.queued_s)
        if self._prefix_caching:
            self.prefix_queries.inc(request.num_prompt_tokens)
            self.prefix_hits.inc(request.num_cached_tokens)


class _EngineCollector(Collector):
    def __init__(self, worker_id: str, requested: PagedAttentionMode) -> None:
        self._worker_id = worker_id
        self._requested = requested
        self._engine: Engine | None = None
        self._realized: RealizedCache | None = None
        self._model_name = ""
        self.state = "loading"

    def attach(self, engine: Engine, realized: RealizedCache, model_name: str) -> None:
        self._engine, self._realized, self._model_name = engine, realized, model_name

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily("kvpact_worker_state", "1 for the worker's current state", labels=["state"])
        for name in WORKER_STATES:
            state.add_metric([name], 1.0 if name == self.state else 0.0)
        yield state
        info = GaugeMetricFamily(
            "kvpact_worker_info", "1, labeled with the worker's identity", labels=["worker_id", "model"]
        )
        info.add_metric([self._worker_id, self._model_name], 1.0)
        yield info
        engine, realized = self._engine, self._realized
        if engine is None or realized is None:
            return
        contract = GaugeMetricFamily(
            "kvpact_worker_paged_attention",
            "1, labeled with the requested --paged-attn mode and the KV cache realized",
            labels=["requested", "realized_kind", "backend"],
        )
        backend = realized.backend.value if realized.backend is not None else ""
        contract.add_metric([self._requested.value, realized.kind.value, backend], 1.0)
        yield contract
        load = engine.stats()
        yield GaugeMetricFamily(
            "kvpact_worker_requests_running", "Sequences running after the last step", value=load.num_running
        )
        yield GaugeMetricFamily(
            "kvpact_worker_requests_waiting", "Sequences waiting after the last step", value=load.num_waiting
        )
        used = load.num_total_blocks - load.num_free_blocks
        yield GaugeMetricFamily(
            "kvpact_worker_kv_usage_ratio",
            "Used fraction of the KV cache (blocks; EAGER: slots)",
            value=used / load.num_total_blocks if load.num_total_blocks else 0.0,
        )
        yield GaugeMetricFamily(
            "kvpact_worker_kv_free_blocks", "Free KV blocks (EAGER: slots)", value=load.num_free_blocks
        )
        yield GaugeMetricFamily(
            "kvpact_worker_kv_total_blocks",
            "KV blocks in the pool (EAGER: slots)",
            value=load.num_total_blocks,
        )
        yield CounterMetricFamily(
            "kvpact_worker_preemptions", "Sequences preempted (recomputed later)", value=load.num_preemptions
        )
        yield CounterMetricFamily(
            "kvpact_worker_kernel_compiles_after_ready",
            "Triton kernel variants compiled after the startup warm-up (each stalls serving; want 0)",
            value=load.kernel_compiles_after_ready,
        )
