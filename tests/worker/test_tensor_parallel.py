"""worker.model.tensor_parallel and the startup checks of --tensor-parallel-size: which shapes split,
what each rank holds, that the row-parallel partial outputs sum to the full layer's, and the refusals
(the processes and the parity through the router: tests/integration/test_multi_device.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvpact.shared.errors import ConfigError, PagedAttentionRequiredError
from kvpact.shared.spec import LayerPlacement
from kvpact.worker.loader import load_model, read_model_config
from kvpact.worker.model.tensor_parallel import rank_shard, shard_model, tp_problem
from kvpact.worker.startup import engine_setup
from tests.worker.conftest import worker_spec


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("weights were loaded (or ranks started) before the verdict")

    monkeypatch.setattr(engine_setup, "load_model", refuse)
    monkeypatch.setattr(engine_setup, "start_ranks", refuse)


def test_smollm2s_9_heads_and_3_kv_heads_split_over_3_ranks_not_2(tiny_llama):
    smollm2 = replace(read_model_config(tiny_llama), num_heads=9, num_kv_heads=3, intermediate_size=1536)
    assert tp_problem(smollm2, 3) == ""
    assert tp_problem(smollm2, 2) == (
        "--tensor-parallel-size 2: the model's 9 attention heads do not divide by 2; use 1, 3, 9"
    )
    shards = [rank_shard(smollm2, r, 3) for r in range(3)]
    assert [(s.head_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in shards] == [
        (0, 3, 0, 1),
        (3, 3, 1, 1),
        (6, 3, 2, 1),
    ]


def test_kv_heads_fewer_than_the_ranks_are_replicated_and_others_refused(tiny_llama):
    config = replace(read_model_config(tiny_llama), num_heads=8, num_kv_heads=2)
    assert [(rank_shard(config, r, 4).kv_start, rank_shard(config, r, 4).num_kv_heads) for r in range(4)] == [
        (0, 1),
        (0, 1),
        (1, 1),
        (1, 1),
    ]
    odd = replace(config, num_heads=12, num_kv_heads=4)
    assert "the model's 4 KV heads can be neither split over 3 ranks nor replicated" in tp_problem(odd, 3)


def test_row_parallel_partial_outputs_sum_to_the_full_layers(tiny_llama):
    full = load_model(tiny_llama).model
    shards = [shard_model(full, r, 2, lambda t: t) for r in range(2)]  # no all-reduce: sum by hand
    x = torch.randn(5, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = full.model.layers[0].mlp(x)
    got = sum(s.model.layers[0].mlp(x) for s in shards)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    whole = full.model.layers[0].self_attn.qkv_proj(x)
    c, half = full.config, full.config.q_size // 2
    kv_half = c.kv_size // 2
    for r, s in enumerate(shards):  # column-parallel: rank r's q, k, v rows are its heads' rows of the full
        mine = s.model.layers[0].self_attn.qkv_proj(x)
        q = slice(r * half, (r + 1) * half)
        k = slice(c.q_size + r * kv_half, c.q_size + (r + 1) * kv_half)
        v = slice(c.q_size + c.kv_size + r * kv_half, c.q_size + c.kv_size + (r + 1) * kv_half)
        assert torch.equal(mine, torch.cat([whole[:, q], whole[:, k], whole[:, v]], dim=1))


def test_a_size_the_heads_do_not_divide_is_refused_before_loading(tiny_llama, no_loading):
    with pytest.raises(ConfigError, match="the model's 4 attention heads do not divide by 3; use 1, 2, 4"):
        engine_setup.plan_startup(replace(worker_spec(tiny_llama), tensor_parallel_size=3))


def test_tensor_parallel_under_on_fails_naming_the_reason_before_loading(tiny_llama, no_loading):
    with pytest.raises(PagedAttentionRequiredError, match="the paged cache is not sharded across ranks"):
        engine_setup.plan_startup(replace(worker_spec(tiny_llama, "on"), tensor_parallel_size=2))


def test_tensor_parallel_with_a_device_map_is_refused(tiny_llama, no_loading):
    spec = replace(
        worker_spec(tiny_llama), tensor_parallel_size=2, device_map=(LayerPlacement("cpu", 1),) * 2
    )
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 with --device-map is not supported"):
        engine_setup.plan_startup(spec)


@pytest.mark.slow  # spawns a rank from the test process (the default suite runs TP=2 through the router)
def test_kv_heads_replicated_over_the_ranks_give_the_one_rank_tokens(tmp_path):
    import asyncio

    from kvpact.worker.startup.engine_setup import build_engine
    from tests.factories.tiny_models import make_tiny_llama
    from tests.worker.conftest import collect, greedy

    one_kv_head = make_tiny_llama(tmp_path / "mqa", num_heads=4, num_kv_heads=1)
    tokens = {}
    for size in (1, 2):
        engine = build_engine(replace(worker_spec(one_kv_head), tensor_parallel_size=size))
        ranks = engine.step_loop.runner.ranks
        try:
            assert engine.step_loop.runner.model.config.num_kv_heads == 1  # replicated, not split
            tokens[size] = asyncio.run(collect(engine, greedy("r", "The quick brown fox", 24))).token_ids
        finally:
            engine.close()
            if ranks is not None:
                ranks.close()
    assert len(tokens[1]) == 24 and tokens[2] == tokens[1]
