"""router.metrics: what a Prometheus scrape shows for the chunks the router relays."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvpact.router.cluster_state import Startup
from kvpact.router.metrics import RouterMetrics
from kvpact.router.registry import Registry

ITL = "kvpact_router_inter_token_latency_seconds"
ITL_EDGES = ("0.005", "0.02", "0.04", "+Inf")


def scrape(metrics: RouterMetrics) -> dict[str, float]:
    lines = generate_latest(metrics.prometheus).decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line.startswith(ITL))}


def test_a_merged_chunk_counts_one_inter_token_gap_per_token_each_its_share_of_the_gap():
    metrics = RouterMetrics(Registry(), Startup(num_expected=1))
    stream = metrics.stream("m")
    stream.chunk(0.5, 1, first=True)  # the first token: time to first token, not a gap
    stream.chunk(0.004, 1, first=False)  # one token 4 ms after it
    stream.chunk(0.12, 4, first=False)  # a merged chunk: four tokens over 120 ms, 30 ms each
    found = scrape(metrics)
    assert found[f'{ITL}_count{{api="grpc",model="m"}}'] == 5.0
    assert found[f'{ITL}_sum{{api="grpc",model="m"}}'] == pytest.approx(0.124)
    buckets = {le: found[f'{ITL}_bucket{{api="grpc",le="{le}",model="m"}}'] for le in ITL_EDGES}
    assert buckets == {"0.005": 1.0, "0.02": 1.0, "0.04": 5.0, "+Inf": 5.0}  # cumulative, as Prometheus reads
