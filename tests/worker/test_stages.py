"""worker.model.stages and worker.kv.staged: a --device-map of two or more entries runs the layers as
stages through the real startup path, on CPU the same staged code a cuda:0 + cpu map runs on a GPU."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from kvpact.shared import reasons
from kvpact.shared.errors import ConfigError, PagedAttentionRequiredError
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.shared.spec import LayerPlacement, parse_device_map
from kvpact.worker.kv.staged import StagedCache
from kvpact.worker.model.stages import Stage, plan_stages
from kvpact.worker.startup import engine_setup
from kvpact.worker.startup.engine_setup import build_engine
from tests.worker.conftest import collect, greedy, worker_spec

STAGED_FALLBACK = (
    "device",
    "--device-map cpu=1,cpu=1 runs the layers as 2 stages and the paged KV cache does not span stages",
)
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without CUDA")


@pytest.fixture
def model(tiny_llama):
    return tiny_llama  # the session's 2-layer model: built once for all the worker tests


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("weights were loaded before the verdict")

    monkeypatch.setattr(engine_setup, "load_model", refuse)


def mapped(model, text: str, mode: str = "auto", **kwargs):  # type: ignore[no-untyped-def]
    return replace(worker_spec(model, mode, **kwargs), device_map=parse_device_map(text))


def fallbacks(state) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(f.component, f.reason) for f in state.fallbacks]


def test_plan_stages_turns_the_map_into_runs_of_layers():
    assert plan_stages([("cpu", 1), ("cpu", 3)], 4, "cpu") == (
        Stage(torch.device("cpu"), 0, 1),
        Stage(torch.device("cpu"), 1, 4),
    )
    with pytest.raises(ValueError, match="the stages place 4 layers, the model has 5"):
        plan_stages([("cpu", 1), ("cpu", 3)], 5, "cpu")
    assert plan_stages([], 4, "cpu") == (Stage(torch.device("cpu"), 0, 4),)


def test_a_staged_map_gives_the_same_greedy_tokens_with_each_layers_cache_in_its_stage(model):
    prompt = "The quick brown fox"
    tokens = {}
    for text in ("", "cpu=1,cpu=1"):
        spec = mapped(model, text) if text else worker_spec(model)
        engine = build_engine(spec)
        try:
            tokens[text] = asyncio.run(collect(engine, greedy("r", prompt, 24))).token_ids
            if text:
                cache = engine.step_loop.runner.cache
                assert isinstance(cache, StagedCache) and engine.realized.kind is CacheKind.EAGER
                assert [len(c.key) for c in cache.caches] == [1, 1]  # each stage holds only its layers
                assert [c.device for c in cache.caches] == [torch.device("cpu")] * 2
                assert [s.describe() for s in engine.step_loop.runner.model.stages] == [
                    "layers 0-0 on cpu",
                    "layers 1-1 on cpu",
                ]
                assert fallbacks(engine.realized) == [("device", reasons.EAGER_DEFAULT.message(device="CPU"))]
        finally:
            engine.close()
    assert len(tokens[""]) == 24 and tokens["cpu=1,cpu=1"] == tokens[""]


def test_a_staged_map_under_on_fails_naming_the_staged_reason_before_loading(model, no_loading):
    with pytest.raises(PagedAttentionRequiredError, match="runs the layers as 2 stages") as info:
        engine_setup.plan_startup(mapped(model, "cpu=1,cpu=1", "on"))
    assert info.value.component == "device"


def test_a_staged_map_under_auto_with_the_torch_backend_plans_eager_with_the_staged_reason(model, no_loading):
    from kvpact.shared.intent import PagedAttentionConfig, PagedAttentionMode, PagedBackend, cache_intent

    spec = replace(
        mapped(model, "cpu=1,cpu=1"),
        cache=cache_intent(PagedAttentionMode.AUTO, PagedAttentionConfig(backend=PagedBackend.TORCH)),
    )
    plan = engine_setup.plan_startup(spec)
    assert plan.kind is CacheKind.EAGER and fallbacks(plan) == [STAGED_FALLBACK]


@NO_CUDA
def test_a_cuda_and_cpu_map_under_on_fails_naming_the_mixed_map_before_loading(model, no_loading):
    with pytest.raises(PagedAttentionRequiredError, match="device mapping includes CPU") as info:
        engine_setup.plan_startup(mapped(model, "cuda:0=1,cpu=1", "on"))
    assert info.value.component == "device"


@NO_CUDA
def test_a_cuda_and_cpu_map_under_auto_on_a_machine_without_cuda_says_which_entry_cannot_run(
    model, no_loading
):
    with pytest.raises(ConfigError) as info:
        engine_setup.plan_startup(mapped(model, "cuda:0=1,cpu=1"))
    assert str(info.value) == (
        "--device-map cuda:0=1,cpu=1: cuda:0 cannot hold its 1 layers because this machine has no usable "
        "CUDA device; map the layers onto devices this machine has (e.g. cpu=2)"
    )


def test_a_map_entry_for_a_gpu_this_machine_lacks_is_named(model, no_loading):
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"cuda:{count} cannot hold its 1 layers because"):
        engine_setup.plan_startup(
            replace(
                worker_spec(model, "off"),
                device_map=(LayerPlacement("cpu", 1), LayerPlacement(f"cuda:{count}", 1)),
            )
        )
