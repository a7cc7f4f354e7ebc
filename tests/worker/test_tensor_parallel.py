"""worker.model.tensor_parallel and the startup checks of --tensor-parallel-size: which shapes split,
what each rank holds, that the row-parallel partial outputs sum to the full layer's, and the refusals
(the processes and the parity through the router: tests/integration/test_multi_device.py)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kvpact.kernels import cpu_paged
from kvpact.shared.errors import (
    ConfigError,
    FeatureRequiredError,
    ModelLoadError,
    PagedAttentionRequiredError,
)
from kvpact.shared.features import FEATURES, FeatureIntents, FeatureMode, FeatureState
from kvpact.shared.spec import LayerPlacement
from kvpact.worker.loader import load_model, read_model_config
from kvpact.worker.model.tensor_parallel import rank_shard, shard_model, tp_problem
from kvpact.worker.parallel.rank_verdict import RankProblem, RankVerdict
from kvpact.worker.parallel.ranks import claim_gpus, rank_visible_devices
from kvpact.worker.startup import checks, engine_setup
from kvpact.worker.startup.device import probe_device
from tests.factories.tiny_models import make_tiny_llama
from tests.worker.conftest import worker_spec
from tests.worker.test_engine_setup import h200_probe


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


def test_a_bfloat16_models_shards_pack_in_pairs_and_their_partial_outputs_sum_to_the_full_layers(tmp_path):
    # --dtype bfloat16 --tensor-parallel-size 2 on the C kernels: each rank packs its own shard's
    # projections in pairs (row-parallel shards halve `in`, which stays even) and computes its share
    bf16 = make_tiny_llama(tmp_path / "bf16", dtype=torch.bfloat16)
    full = load_model(bf16, dtype=torch.bfloat16).model
    shards = [shard_model(full, r, 2, lambda t: t) for r in range(2)]  # no all-reduce: sum by hand
    ops = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(ops, str)
    if not ops.panel_width:
        pytest.skip("this build packs no weights (kvp_panel_width 0: the CPU has neither AVX-512 nor AVX2)")
    for shard in shards:
        assert engine_setup.use_cpu_kernels(shard, True).endswith("(bfloat16 pairs)")
        assert shard.model.layers[0].mlp.down_proj.packed
    x = torch.randn(5, full.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = full.model.layers[0].mlp(x).float()
    got = sum(s.model.layers[0].mlp(x).float() for s in shards)
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2e-2)  # each share rounded to bf16, then summed


def test_a_size_the_heads_do_not_divide_is_refused_before_loading(tiny_llama, no_loading):
    with pytest.raises(ConfigError, match="the model's 4 attention heads do not divide by 3; use 1, 2, 4"):
        engine_setup.plan_startup(replace(worker_spec(tiny_llama), tensor_parallel_size=3))


def planning(spec, probe, *verdicts: RankVerdict) -> checks.Planning:  # type: ignore[no-untyped-def]
    """Rank 0's plan being made, with the other ranks' verdicts as they arrived (rank_verdict.py)."""
    p = engine_setup._begin(spec, probe)
    p.rank_verdicts = verdicts
    return p


@pytest.fixture(scope="module")
def head64_llama(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A head size the Triton kernels take (a described H200 then plans paged)."""
    return make_tiny_llama(tmp_path_factory.mktemp("head64"), hidden_size=128, num_heads=2, num_kv_heads=1,
                           head_dim=64)  # fmt: skip


def verdict(rank: int, device: str, num_blocks: int = 0, **off: tuple[str, str]) -> RankVerdict:
    """A rank's own verdict: every feature realized (asked auto) but those in `off` (name_with_underscores=
    (code, message)), as follower.own_verdict sends it."""
    states = []
    for name in FEATURES:
        code, message = off.get(name.replace("-", "_"), ("", ""))
        states.append(
            FeatureState(name, FeatureMode.AUTO, not message, code, message, "device" if message else "")
        )
    return RankVerdict(rank, device, features=tuple(states), num_blocks=num_blocks)


NO_SM = "the Triton paged kernels need compute capability (8, 0) or newer; cuda:2 has (7, 0)"


def test_a_rank_that_cannot_page_fails_on_naming_the_rank_before_loading(tiny_llama, no_loading):
    spec = replace(worker_spec(tiny_llama, "on"), tensor_parallel_size=3)
    refused = RankProblem("required", NO_SM, "device", "paged-attn", "compute-capability")
    p = planning(spec, probe_device("cpu"), verdict(1, "cpu", 64),
                 RankVerdict(2, "cuda:2", problem=refused))  # fmt: skip
    with pytest.raises(PagedAttentionRequiredError) as info:
        checks.run_checks(p)
    assert f"but rank 2 (cuda:2) cannot realize it: {NO_SM}." in str(info.value)
    assert info.value.code == "tensor-parallel-rank"


def test_under_auto_every_rank_falls_back_together_with_the_ranks_reason(
    head64_llama, no_loading, monkeypatch
):
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: None)
    spec = replace(worker_spec(head64_llama, "auto", max_model_len=512), tensor_parallel_size=2)
    p = planning(spec, h200_probe(2**30), verdict(1, "cuda:1", paged_attn=("compute-capability", NO_SM)))
    checks.run_checks(p)
    assert not p.paged  # rank 0 could page; it does not, since rank 1 cannot
    assert [(f.component, f.message) for f in [p.ledger.findings["paged-attn"]]] == [
        ("device", f"rank 1 (cuda:1) cannot realize it: {NO_SM}")
    ]
    assert not p.in_force("prefix-caching")  # read after the ranks' verdict


def test_the_ranks_paged_pools_hold_the_smallest_ranks_blocks(tiny_llama, no_loading):
    spec = replace(worker_spec(tiny_llama, "on"), tensor_parallel_size=2)
    p = planning(spec, probe_device("cpu"), verdict(1, "cpu", 7))
    checks.run_checks(p)
    assert p.paged and p.paged_size is not None and p.paged_size.num_blocks == 7


NO_CC = "the C kernels cannot be built here: no C compiler found (install gcc or set CC)"


def test_under_auto_every_other_feature_falls_back_on_every_rank_with_the_ranks_reason(
    tiny_llama, no_loading
):
    spec = replace(worker_spec(tiny_llama), tensor_parallel_size=2)
    rank_1 = verdict(1, "cpu", cpu_kernels=("c-kernels-build", NO_CC))
    plan = engine_setup.plan_startup(spec, rank_verdicts=(rank_1,))
    (kernels,) = [f for f in plan.features if f.name == "cpu-kernels"]
    assert (kernels.realized, kernels.code) == (False, "tensor-parallel-rank")
    assert kernels.message == f"rank 1 (cpu) cannot realize it: {NO_CC}"
    assert engine_setup.rank_build(plan).cpu_kernels is False  # so every rank builds the torch kernels


@pytest.mark.parametrize("how", ["its plan fell back", "its plan refused on"])
def test_under_on_a_ranks_refusal_of_another_feature_fails_before_loading_naming_it(
    tiny_llama, no_loading, how
):
    features = FeatureIntents(cpu_kernels=FeatureMode.ON)
    spec = replace(worker_spec(tiny_llama, features=features), tensor_parallel_size=2)
    if how == "its plan refused on":
        problem = RankProblem("required", NO_CC, "build", "cpu-kernels", "c-kernels-build")
        rank_1 = RankVerdict(1, "cpu", problem=problem)
    else:
        rank_1 = verdict(1, "cpu", cpu_kernels=("c-kernels-build", NO_CC))
    with pytest.raises(FeatureRequiredError) as info:
        engine_setup.plan_startup(spec, rank_verdicts=(rank_1,))
    assert (info.value.rank, info.value.feature, info.value.code) == (
        1,
        "cpu-kernels",
        "tensor-parallel-rank",
    )
    assert str(info.value) == (
        "The C CPU kernels were explicitly requested (--cpu-kernels on), but rank 1 (cpu) cannot realize "
        f"it: {NO_CC}. [device]"
    )


def test_every_feature_of_the_registry_is_checked_on_every_rank():
    names = [getattr(check, "__name__", "") for _, check in checks.CHECKS]
    assert [n for n in names if n.startswith("every_rank")] == [
        "every_rank(prefix-caching)", "every_rank(cpu-kernels)", "every_rank(quant-kernels)",
        "every_rank(cuda-graphs)"
    ]  # fmt: skip
    assert names.index("every_rank(cpu-kernels)") == names.index("cpu_kernels_build") + 1
    # a feature with no checks of its own (one added to the registry later) still gets its agreement
    only_paged = checks.agreed_on_every_rank((("paged-attn", checks.paged_device),))
    assert [c.__name__ for _, c in only_paged] == ["paged_device"] + [
        f"every_rank({f})" for f in FeatureIntents.names()
    ]


def test_a_ranks_failure_is_raised_on_rank_0_naming_the_rank():
    error = RankProblem.of(ModelLoadError("cannot read model.safetensors")).error(1, "cpu")
    assert isinstance(error, ModelLoadError) and error.rank == 1
    assert str(error) == "rank 1 (cpu): cannot read model.safetensors"


def test_each_rank_sees_only_its_own_gpu_when_the_worker_has_one_per_rank(monkeypatch):
    assert [rank_visible_devices("4,5", 2, r) for r in range(2)] == ["4", "5"]
    assert rank_visible_devices("0", 2, 1) == "0" and rank_visible_devices(None, 2, 1) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # a Ray bundle of 2 GPUs
    assert claim_gpus(2) == "4,5" and os.environ["CUDA_VISIBLE_DEVICES"] == "4"  # rank 0 keeps its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a bundle without GPUs: unchanged
    assert claim_gpus(2) == "" and os.environ["CUDA_VISIBLE_DEVICES"] == ""


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


def test_a_ranks_paged_refusal_is_raised_once_named_as_that_ranks_not_rank_0s(tiny_llama, no_loading):
    """The worker's line reads `worker a rank 1: ...` (process.py reads `.rank`), and the reason is rank 1's,
    not wrapped once more as rank 0's."""
    spec = replace(worker_spec(tiny_llama, "on"), tensor_parallel_size=2)
    refused = RankProblem("required", NO_SM, "device", "paged-attn", "compute-capability")
    with pytest.raises(PagedAttentionRequiredError) as info:
        engine_setup.plan_startup(spec, rank_verdicts=(RankVerdict(1, "cuda:1", problem=refused),))
    assert info.value.rank == 1
    assert info.value.reason == f"rank 1 (cuda:1) cannot realize it: {NO_SM}"
