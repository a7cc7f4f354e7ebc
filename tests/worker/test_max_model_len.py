"""--max-model-len auto (the CUDA default): the longest sequence the realized cache holds, up to the
model's positions; an explicit value that cannot fit names the largest that would."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpact.shared.errors import ConfigError, PagedAttentionRequiredError
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.worker.cli import parse_args
from kvpact.worker.kv import sizing
from kvpact.worker.startup import checks, engine_setup
from tests.worker.conftest import worker_spec
from tests.worker.test_engine_setup import h200_probe, head64_llama, no_loading  # noqa: F401 - fixtures

MODEL_POSITIONS = 512  # the tiny models' max_position_embeddings
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny llama: K+V x 2 layers x 2 kv heads x head_dim 16 x fp32


def auto(spec):  # type: ignore[no-untyped-def]
    return replace(spec, max_model_len=0, max_model_len_auto=True)


def test_auto_with_room_for_the_whole_model_is_the_models_positions(tiny_llama, no_loading):  # noqa: F811
    plan = engine_setup.plan_startup(auto(worker_spec(tiny_llama, "on", context_tokens=4096)))
    assert plan.max_model_len == MODEL_POSITIONS
    assert plan.max_model_len_source == "auto: the model's 512 positions (the pool holds 4096 tokens)"


def test_auto_shrinks_to_what_one_pool_holds_and_says_how(tiny_llama, no_loading):  # noqa: F811
    plan = engine_setup.plan_startup(auto(worker_spec(tiny_llama, "on", context_tokens=200)))
    assert plan.kind is CacheKind.PAGED
    assert plan.max_model_len == 208  # 13 blocks of 16
    assert plan.max_model_len_source == (
        "auto: the pool holds 208 tokens (--pa-context-tokens 200), fewer than the model's 512 positions"
    )
    assert plan.log_fields()["max_model_len_source"] == plan.max_model_len_source


def test_an_explicit_length_that_cannot_fit_fails_under_on_naming_the_largest_that_fits(
    tiny_llama,
    head64_llama,  # noqa: F811
    no_loading,  # noqa: F811
    monkeypatch,
):
    with pytest.raises(PagedAttentionRequiredError) as info:
        engine_setup.plan_startup(worker_spec(tiny_llama, "on", max_model_len=512, context_tokens=200))
    assert info.value.component == "cache-budget"
    assert "or lower --max-model-len (the largest that fits is 208)" in str(info.value)
    # under auto (on a GPU, where auto would use PagedAttention): it falls back to the eager cache and
    # says why, with the same kind of figure
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: "")
    spec = worker_spec(head64_llama, "auto", max_model_len=512, context_tokens=100)
    plan = engine_setup.plan_startup(replace(spec, device="cuda"), probe=h200_probe(2**30))
    assert plan.kind is CacheKind.EAGER
    [fallback] = plan.fallbacks
    assert fallback.component == "cache-budget"
    assert "(the largest that fits is 112)" in fallback.reason
    assert plan.max_model_len == 512


def test_eager_auto_fits_the_slots_into_free_memory(head64_llama, no_loading):  # noqa: F811
    free = 64 * 2**20
    spec = auto(worker_spec(head64_llama, "off", max_num_seqs=4))
    spec = replace(spec, device="cuda")
    plan = engine_setup.plan_startup(spec, probe=h200_probe(free))
    largest = sizing.largest_eager_len(
        num_slots=4,
        bytes_per_token=plan.bytes_per_token,
        weight_bytes=plan.weight_bytes,
        memory_free_bytes=free,
    )
    assert plan.kind is CacheKind.EAGER
    assert plan.max_model_len == min(largest, MODEL_POSITIONS)
    # an explicit value beyond it is refused with that figure
    tight = 3 * 2**19
    largest = sizing.largest_eager_len(
        num_slots=4,
        bytes_per_token=plan.bytes_per_token,
        weight_bytes=plan.weight_bytes,
        memory_free_bytes=tight,
    )
    assert 0 < largest < 512
    with pytest.raises(ConfigError, match=rf"the largest that fits with --max-num-seqs 4 is {largest}\)"):
        engine_setup.plan_startup(
            replace(spec, max_model_len=512, max_model_len_auto=False), probe=h200_probe(tight)
        )
    plan = engine_setup.plan_startup(spec, probe=h200_probe(tight))
    assert plan.max_model_len == largest
    assert plan.max_model_len_source.startswith(f"auto: 4 eager slots of {largest} tokens fit in 0.9 x")


def test_on_cuda_the_default_is_auto(head64_llama, no_loading, monkeypatch):  # noqa: F811
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: "")
    spec = replace(worker_spec(head64_llama, "on", context_tokens=100), max_model_len=0)
    plan = engine_setup.plan_startup(spec, probe=h200_probe(2**30))
    assert plan.max_model_len == 112  # 7 blocks of 16: what one pool holds, not the model's 512
    assert plan.max_model_len_source.startswith("auto: the pool holds 112 tokens")
    # on CPU the default stays min(the model's positions, 2048)
    plan = engine_setup.plan_startup(
        replace(worker_spec(head64_llama, "on", context_tokens=4096), max_model_len=0)
    )
    assert plan.max_model_len_source == "the default: min(the model's 512 positions, 2048)"


def test_the_engine_realizes_the_fitted_length(tiny_llama, make_engine):
    engine = engine_setup.build_engine(auto(worker_spec(tiny_llama, "on", context_tokens=200)))
    try:
        assert engine.realized.max_model_len == engine.max_model_len == 208
    finally:
        engine.close()


def test_the_flag_takes_auto():
    options = parse_args(["--max-model-len", "auto"])
    assert (options.spec.max_model_len, options.spec.max_model_len_auto) == (0, True)
    options = parse_args(["--max-model-len", "300"])
    assert (options.spec.max_model_len, options.spec.max_model_len_auto) == (300, False)
