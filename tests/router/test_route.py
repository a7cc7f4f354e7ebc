"""Balancer choice and model resolution, over registry entries (no sockets)."""

import pytest

from kvpact.router.balancing.least_load import least_loaded as choose
from kvpact.router.balancing.route import resolve_model, route
from kvpact.router.errors import InvalidRequest, NoLiveWorker, UnknownModel
from kvpact.router.registry import Registry, WorkerEntry, WorkerState
from kvpact.shared.handshake import WorkerLoad
from kvpact.v1 import worker_pb2
from tests.router.doubles import paged_realized, spec


def entry(worker_id, model="tiny", *, outstanding=0, free=0, state=WorkerState.ADMITTED):
    return WorkerEntry(
        worker_id=worker_id,
        address=f"{worker_id}:1",
        model_name=model,
        spec=spec("on"),
        capabilities=worker_pb2.Capabilities(),
        realized=paged_realized(),
        failure=None,
        state=state,
        state_reason="",
        last_heartbeat=0.0,
        load=WorkerLoad(num_free_blocks=free),
        num_outstanding=outstanding,
    )


def test_least_outstanding_wins():
    assert choose([entry("a", outstanding=2, free=100), entry("b", outstanding=1, free=0)]).worker_id == "b"


def test_ties_go_to_more_free_blocks_then_to_the_id():
    assert choose([entry("a", outstanding=1, free=3), entry("b", outstanding=1, free=9)]).worker_id == "b"
    assert choose([entry("b", free=5), entry("a", free=5)]).worker_id == "a"


def registry(*entries):
    r = Registry()
    for e in entries:
        r.add(e)
    return r


def test_the_only_model_is_the_default():
    r = registry(entry("a"), entry("b", outstanding=1))
    assert resolve_model(r, "")[0] == "tiny"
    assert route(r, "").worker_id == "a"


def test_several_models_need_a_name():
    r = registry(entry("a", "llama"), entry("b", "qwen"))
    with pytest.raises(InvalidRequest, match=r"serves several models \(llama, qwen\)"):
        route(r, "")
    assert route(r, "qwen").worker_id == "b"


def test_unknown_model_lists_the_served_ones():
    r = registry(entry("a", "llama"), entry("b", "qwen"))
    with pytest.raises(UnknownModel, match=r"model 'mistral' is not served here; served models: llama, qwen"):
        route(r, "mistral")


def test_a_model_whose_workers_are_all_dead_is_unavailable():
    r = registry(entry("a", state=WorkerState.DEAD), entry("b", state=WorkerState.REFUSED, model="other"))
    with pytest.raises(NoLiveWorker, match="no live worker serves model 'tiny'"):
        route(r, "tiny")
    with pytest.raises(UnknownModel):  # a refused worker's model is not served
        route(r, "other")


def test_no_worker_at_all_is_unavailable():
    with pytest.raises(NoLiveWorker):
        route(Registry(), "")


def test_heartbeat_timeout_marks_dead_and_a_heartbeat_revives():
    r = registry(entry("a"), entry("b"))
    r.heartbeat("b", WorkerLoad(num_free_blocks=7), now=9.0)
    dead = r.mark_dead(now=10.5, timeout_s=10.0)
    assert [e.worker_id for e in dead] == ["a"]
    assert r.get("a").state is WorkerState.DEAD and "no heartbeat for 10.5 s" in r.get("a").state_reason
    assert r.get("b").state is WorkerState.ADMITTED and r.get("b").load.num_free_blocks == 7
    assert r.mark_dead(now=10.6, timeout_s=10.0) == []  # already dead: reported once
    r.heartbeat("a", WorkerLoad(), now=11.0)
    assert r.get("a").state is WorkerState.ADMITTED
    assert r.heartbeat("zed", WorkerLoad(), now=11.0) is None
