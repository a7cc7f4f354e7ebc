"""worker.engine_setup: the contract inside the worker. Every "cannot" goes through the fallback door
(auto: recorded, on: PagedAttentionRequiredError), before any weight is loaded; the realized cache
and scheduler follow what was built."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvpact.kernels import cpu_paged
from kvpact.shared import reasons
from kvpact.shared.capability import DeviceInfo
from kvpact.shared.describe import realized_table
from kvpact.shared.errors import ConfigError, PagedAttentionRequiredError
from kvpact.shared.features import FeatureIntents, FeatureMode
from kvpact.shared.intent import PagedBackend
from kvpact.shared.reasons import Finding
from kvpact.shared.scheduler_choice import CacheKind
from kvpact.shared.spec import LayerPlacement
from kvpact.v1 import cache_pb2
from kvpact.worker.generate_pb import capabilities_to_pb
from kvpact.worker.kv import sizing
from kvpact.worker.loader import estimate_weight_bytes
from kvpact.worker.scheduler.eager import EagerScheduler
from kvpact.worker.scheduler.paged import PagedScheduler
from kvpact.worker.startup import checks, engine_setup
from kvpact.worker.startup.device import KERNEL_SUPPORT, DeviceProbe
from tests.factories.tiny_models import make_tiny_llama
from tests.worker.conftest import collect, greedy, paced_steps, worker_spec

GiB = 2**30
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V x 2 layers x 2 kv heads x head_dim 16 x fp32


def fallbacks(plan_or_realized) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(f.component, f.reason) for f in plan_or_realized.fallbacks]


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything tries to load weights."""

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("weights were loaded before the verdict")

    monkeypatch.setattr(engine_setup, "load_model", refuse)


# ---- CPU: the three modes ----


def test_cpu_auto_realizes_eager_and_says_why(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, "auto")
    r = engine.realized
    assert (r.kind, r.scheduler, r.backend) == (CacheKind.EAGER, "default", None)
    assert fallbacks(r) == [
        ("device", "eager is the CPU default (use --paged-attn on for the torch paged backend)")
    ]
    assert "fallback (device)  eager is the CPU default" in realized_table(r)
    assert isinstance(engine.step_loop.scheduler, EagerScheduler)
    # the CPU defaults: 8 slots reserved at max_model_len
    assert (r.num_blocks, r.max_concurrency, r.capacity_tokens) == (8, 8, 8 * 256)
    assert r.memory_bytes == 8 * 256 * BYTES_PER_TOKEN


def test_cpu_on_realizes_the_torch_paged_backend(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, "on", context_tokens=1000)
    r = engine.realized
    assert (r.kind, r.scheduler, r.backend, r.block_size) == (
        CacheKind.PAGED,
        "paged",
        PagedBackend.TORCH,
        16,
    )
    assert (r.num_blocks, r.capacity_tokens, r.max_concurrency) == (63, 1008, 3)
    assert r.memory_bytes == 1008 * BYTES_PER_TOKEN and r.prefix_caching and fallbacks(r) == []
    assert isinstance(engine.step_loop.scheduler, PagedScheduler)


def test_cpu_off_realizes_eager_with_no_fallback(make_engine, tiny_llama):
    r = make_engine(tiny_llama, "off").realized
    assert (r.kind, r.scheduler, fallbacks(r)) == (CacheKind.EAGER, "default", [])


def test_cpu_default_paged_budget_is_capped_at_what_max_num_seqs_can_use(tiny_llama, no_loading):
    plan = engine_setup.plan_startup(worker_spec(tiny_llama, "on"))  # no --pa-* budget: min(1 GiB, 10% RAM)
    assert plan.paged_size is not None
    assert plan.paged_size.num_blocks == 32 * 256 // 16  # 32 sequences x max_model_len 256
    assert plan.max_num_seqs == sizing.CPU_DEFAULTS.paged_max_num_seqs


@pytest.mark.parametrize(
    ("mode", "flag", "beside_flag", "budget", "beside_decodes"),
    [
        ("on", 0, 0, 2048, 12),  # the CPU default: 2048 a step, at most 12 prompt tokens beside decodes
        ("off", 0, 0, 2048, 12),
        ("on", 64, 0, 64, None),  # an explicit budget is the step's budget whatever runs
        ("off", 4096, 0, 4096, None),
        ("on", 0, 24, 2048, 24),  # --prompt-tokens-beside-decodes sets the bound, with either budget
        ("off", 4096, 32, 4096, 32),
    ],
)
def test_cpu_step_token_budget_and_its_prompt_share_beside_decodes(
    tiny_llama, no_loading, mode, flag, beside_flag, budget, beside_decodes
):
    spec = replace(
        worker_spec(tiny_llama, mode, max_num_batched_tokens=flag), prompt_tokens_beside_decodes=beside_flag
    )
    plan = engine_setup.plan_startup(spec)
    assert (plan.max_num_batched_tokens, plan.prompt_tokens_beside_decodes) == (budget, beside_decodes)
    assert plan.log_fields()["prompt_tokens_beside_decodes"] == beside_decodes


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_the_prompt_bound_beside_decodes_reaches_the_scheduler(tiny_llama):
    """Two sequences decode, a 100-token prompt arrives: --prompt-tokens-beside-decodes 8 prefills it
    8 tokens a step beside them (steps paced: a tiny model's steps, prompt chunks' too, take well under
    a millisecond in the C call, so the decoders would otherwise finish before the prompt arrives)."""
    spec = replace(worker_spec(tiny_llama, "on", context_tokens=1024), prompt_tokens_beside_decodes=8)
    engine = engine_setup.build_engine(engine_setup.plan_startup(spec))
    paced_steps(engine)
    try:
        scheduler = engine.step_loop.scheduler
        assert scheduler.prompt_tokens_beside_decodes == 8
        chunks: list[int] = []
        schedule = scheduler.schedule

        def recorded():
            out = schedule()
            decodes = [c for c in out.chunks if c.num_tokens == 1 and c.seq.request_id.startswith("d")]
            if decodes:
                chunks.extend(c.num_tokens for c in out.chunks if c.seq.request_id == "long")
            return out

        scheduler.schedule = recorded

        async def long_prompt_after_two_decoders() -> None:
            decoders = [engine.generate(greedy(f"d{n}x", [5 + n, 6, 7], 60)) for n in range(2)]
            for stream in decoders:  # each has its first token: both decode from here on
                await asyncio.wait_for(anext(stream), 60)
            await asyncio.wait_for(collect(engine, greedy("long", list(range(1, 101)), 2)), 60)
            for stream in decoders:
                await asyncio.wait_for(_drain(stream), 60)

        asyncio.run(long_prompt_after_two_decoders())
        assert chunks and max(chunks) <= 8 and sum(chunks) >= 64, chunks  # most of it beside decodes
    finally:
        engine.close()


# ---- the cache budget ----


def test_on_with_a_budget_too_small_fails_before_loading_naming_tokens_and_flag(tiny_llama, no_loading):
    with pytest.raises(PagedAttentionRequiredError) as info:
        engine_setup.plan_startup(worker_spec(tiny_llama, "on", context_tokens=100))
    error = info.value
    assert error.component == "cache-budget"
    assert "holds only 112 tokens (7 blocks of 16)" in str(error)
    assert "--max-model-len 256" in str(error) and "raise --pa-context-tokens" in str(error)
    assert str(error).startswith("PagedAttention was explicitly requested (--paged-attn on), but")


def test_on_with_a_byte_budget_too_small_names_that_flag(tiny_llama, no_loading):
    with pytest.raises(PagedAttentionRequiredError, match="raise --pa-memory-bytes"):
        engine_setup.plan_startup(worker_spec(tiny_llama, "on", memory_bytes=64 * BYTES_PER_TOKEN))


def test_auto_with_a_budget_too_small_falls_back_to_eager_and_records_why(make_engine, tiny_llama):
    # --pa-backend torch makes auto try the paged cache on CPU; the budget then cannot hold 256 tokens
    engine = make_engine(tiny_llama, "auto", backend=PagedBackend.TORCH, context_tokens=100)
    r = engine.realized
    assert (r.kind, r.scheduler) == (CacheKind.EAGER, "default")
    [(component, reason)] = fallbacks(r)
    assert component == "cache-budget" and "holds only 112 tokens" in reason
    assert engine.run([greedy("r", (5, 6, 7), 4)])[0].usage.completion_tokens == 4  # and it serves


def test_an_eager_cache_that_cannot_fit_names_the_flags(tiny_llama, no_loading):
    with pytest.raises(ConfigError) as info:
        engine_setup.plan_startup(worker_spec(tiny_llama, "off", max_num_seqs=1_000_000))
    assert "--max-num-seqs 1000000 x --max-model-len 256" in str(info.value)
    assert "lower --max-num-seqs or --max-model-len" in str(info.value)


def test_max_model_len_beyond_the_model_is_refused(tiny_llama, no_loading):
    with pytest.raises(ConfigError, match="--max-model-len 4096 is longer than the model's 512 positions"):
        engine_setup.plan_startup(worker_spec(tiny_llama, "auto", max_model_len=4096))


def test_a_device_map_that_does_not_cover_the_model_says_what_the_counts_must_add_up_to(
    tiny_llama, no_loading
):
    spec = replace(worker_spec(tiny_llama), device_map=(LayerPlacement("cpu", 1),))
    with pytest.raises(ConfigError, match="places 1 layers but the model has 2; make the counts add up to 2"):
        engine_setup.plan_startup(spec)


# ---- loader findings: sliding window ----


@pytest.fixture(scope="module")
def windowed_llama(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("windowed")
    shutil.copytree(tiny_llama, directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sliding_window": 32}))
    return directory


def test_sliding_window_under_on_fails_naming_the_window(windowed_llama, no_loading):
    with pytest.raises(
        PagedAttentionRequiredError, match=r"sliding-window attention \(window 32 tokens\)"
    ) as info:
        engine_setup.plan_startup(worker_spec(windowed_llama, "on", context_tokens=1024))
    assert info.value.component == "loader" and "lower it to 32" in str(info.value)


def test_sliding_window_under_auto_falls_back_to_the_windowed_eager_cache(make_engine, windowed_llama):
    engine = make_engine(windowed_llama, "auto", backend=PagedBackend.TORCH, context_tokens=1024)
    assert engine.realized.kind is CacheKind.EAGER
    assert [c for c, _ in fallbacks(engine.realized)] == ["loader"]
    assert engine.step_loop.runner.cache.sliding_window == 32


def test_sliding_window_longer_than_max_model_len_is_no_obstacle(windowed_llama, no_loading):
    plan = engine_setup.plan_startup(worker_spec(windowed_llama, "on", max_model_len=32, context_tokens=1024))
    assert plan.kind is CacheKind.PAGED and fallbacks(plan) == []


# ---- described CUDA devices (decision and sizing only; nothing runs on a GPU) ----


@pytest.fixture(autouse=True)
def described_gpus_pass_the_kernel_self_test(monkeypatch):
    """A described CUDA device has no GPU to run the Triton self-test on: it passes unless a test
    says otherwise (tests/worker/test_kernel_check.py tests the self-test itself)."""
    monkeypatch.setattr(checks, "triton_self_test", lambda *args, **kwargs: "")


def cuda_probe(cc=(9, 0), triton="3.9.0", free=70 * GiB) -> DeviceProbe:  # type: ignore[no-untyped-def]
    info = DeviceInfo(
        kind="cuda",
        name="Described H100",
        compute_capability=cc,
        triton_version=triton,
        triton_support=KERNEL_SUPPORT,
    )
    return DeviceProbe(info, torch.device("cpu"), 80 * GiB, free)


@pytest.fixture(scope="module")
def head64_llama(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("head64"), hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64
    )


def plan_on(model, probe, mode="auto", **kwargs):  # type: ignore[no-untyped-def]
    return engine_setup.plan_startup(
        replace(worker_spec(model, mode, **kwargs), dtype="float16"), probe=probe
    )


def test_a_described_cuda_device_with_triton_selects_the_triton_backend(head64_llama, no_loading):
    plan = plan_on(head64_llama, cuda_probe(), max_model_len=512)
    assert (plan.kind, plan.backend, fallbacks(plan)) == (CacheKind.PAGED, PagedBackend.TRITON, [])
    assert plan.max_num_seqs == sizing.GPU_DEFAULTS.paged_max_num_seqs
    # the CUDA default budget (0.9 x free - weights - activations) is far more than 256 x 512 tokens
    assert plan.paged_size is not None and plan.paged_size.num_blocks == 256 * 512 // 16
    assert capabilities_to_pb(plan.probe).supported_backends == [
        cache_pb2.PAGED_BACKEND_TORCH,
        cache_pb2.PAGED_BACKEND_TRITON,
    ]


def test_a_described_old_gpu_falls_back_under_auto_and_fails_under_on(head64_llama, no_loading):
    plan = plan_on(head64_llama, cuda_probe(cc=(7, 0)))
    assert plan.kind is CacheKind.EAGER
    assert fallbacks(plan) == [
        ("device", "the Triton paged kernels need compute capability >= 8.0 and Described H100 has 7.0")
    ]
    with pytest.raises(PagedAttentionRequiredError, match="compute capability >= 8.0"):
        plan_on(head64_llama, cuda_probe(cc=(7, 0)), mode="on")


def test_a_head_size_the_triton_kernels_cannot_take_is_named(tiny_llama, no_loading):
    with pytest.raises(
        PagedAttentionRequiredError, match="head size 16 is not one the Triton paged kernels take"
    ):
        plan_on(tiny_llama, cuda_probe(), mode="on")


def test_a_gpu_without_room_for_one_sequence_fails_under_on(head64_llama, no_loading):
    with pytest.raises(PagedAttentionRequiredError, match="the CUDA default: 0.9 x") as info:
        plan_on(head64_llama, cuda_probe(free=300 * 2**20), mode="on")
    assert info.value.component == "cache-budget"


def h200_probe(free: int) -> DeviceProbe:
    """A described H200 whose device is cuda:0 (nothing here touches it)."""
    info = DeviceInfo(
        kind="cuda",
        name="Described H200",
        compute_capability=(9, 0),
        triton_version="3.9.0",
        triton_support=KERNEL_SUPPORT,
    )
    return DeviceProbe(info, torch.device("cuda", 0), 141 * GiB, free)


def test_a_described_h200_plans_bf16_triton_and_the_cuda_default_budget(
    head64_llama, no_loading, monkeypatch
):
    tested = []
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: tested.append((a, k)) or "")
    free = 320 * 2**20  # small enough that the budget, not max_num_seqs x max_model_len, sets the size
    plan = engine_setup.plan_startup(
        worker_spec(head64_llama, "auto", max_model_len=512), probe=h200_probe(free)
    )
    assert (plan.dtype, plan.cache_dtype) == (torch.bfloat16, torch.bfloat16)  # auto on sm_90
    assert (plan.kind, plan.backend, fallbacks(plan)) == (CacheKind.PAGED, PagedBackend.TRITON, [])
    # weights estimated in bf16 (2 bytes a parameter; the checkpoint on disk is fp32)
    assert plan.weight_bytes == estimate_weight_bytes(head64_llama, dtype=torch.float32) // 2
    assert plan.bytes_per_token == 2 * 2 * 1 * 64 * 2  # K+V x 2 layers x 1 kv head x head_dim 64 x bf16
    activations = sizing.activation_headroom_bytes(
        device_kind="cuda",
        hidden_size=128,
        intermediate_size=128,
        vocab_size=plan.model_config.vocab_size,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        dtype_bytes=2,
    )
    # 0.9 x the memory free before loading, less the weights once and the activation headroom
    budget = int(0.9 * free) - plan.weight_bytes - activations
    assert plan.paged_size is not None
    assert plan.paged_size.num_blocks == budget // (16 * plan.bytes_per_token) < 256 * 512 // 16
    assert plan.paged_size.budget.startswith("the CUDA default: 0.9 x 320.0 MiB free")
    # the self-test ran once, on the probed device, with the model's shapes and the KV dtype
    assert tested == [
        (
            (torch.device("cuda", 0), torch.bfloat16),
            dict(num_heads=2, num_kv_heads=1, head_dim=64, block_size=16),
        )
    ]


def test_pa_memory_fraction_is_that_fraction_of_free_memory_less_weights_and_activations(
    head64_llama, no_loading
):
    free = 2 * GiB
    plan = engine_setup.plan_startup(
        worker_spec(head64_llama, "on", max_model_len=512, memory_fraction=0.25), probe=h200_probe(free)
    )
    activations = sizing.activation_headroom_bytes(
        device_kind="cuda",
        hidden_size=128,
        intermediate_size=128,
        vocab_size=plan.model_config.vocab_size,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        dtype_bytes=2,
    )
    assert plan.paged_size is not None
    budget = int(0.25 * free) - plan.weight_bytes - activations
    assert plan.paged_size.num_blocks == budget // (16 * plan.bytes_per_token)
    assert plan.paged_size.budget.startswith("--pa-memory-fraction 0.25 of 2.00 GiB free, less")


def test_a_failing_kernel_self_test_falls_back_under_auto_and_fails_under_on(
    head64_llama, no_loading, monkeypatch
):
    reason = "the Triton paged kernels failed a startup self-test on Described H200 (cuda:0): RuntimeError: x"
    found = Finding(reasons.KERNEL_SELF_TEST, reason)
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: found)
    plan = engine_setup.plan_startup(
        worker_spec(head64_llama, "auto", max_model_len=512), probe=h200_probe(GiB)
    )
    assert (plan.kind, plan.backend, plan.paged_size) == (CacheKind.EAGER, None, None)
    assert fallbacks(plan) == [("kernels", reason)]
    assert plan.max_num_seqs == sizing.GPU_DEFAULTS.eager_max_num_seqs
    with pytest.raises(PagedAttentionRequiredError, match="failed a startup self-test") as info:
        engine_setup.plan_startup(worker_spec(head64_llama, "on", max_model_len=512), probe=h200_probe(GiB))
    assert info.value.component == "kernels"


def test_the_torch_backend_on_a_gpu_runs_no_triton_self_test(head64_llama, no_loading, monkeypatch):
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: pytest.fail("self-test ran"))
    spec = worker_spec(head64_llama, "on", max_model_len=512, backend=PagedBackend.TORCH)
    plan = engine_setup.plan_startup(spec, probe=h200_probe(GiB))
    assert (plan.kind, plan.backend) == (CacheKind.PAGED, PagedBackend.TORCH)


# ---- the verdict comes before the weights ----


def test_build_engine_loads_weights_only_after_a_passing_verdict(tiny_llama, monkeypatch):
    plan = engine_setup.plan_startup(worker_spec(tiny_llama, "on", context_tokens=1024))
    loaded = []
    real = engine_setup.load_model
    monkeypatch.setattr(engine_setup, "load_model", lambda *a, **k: loaded.append(a) or real(*a, **k))
    engine = engine_setup.build_engine(plan)
    try:
        assert len(loaded) == 1 and engine.realized.kind is CacheKind.PAGED
    finally:
        engine.close()


def test_cpu_kernels_off_builds_the_torch_path(make_engine, tiny_llama):
    engine = make_engine(tiny_llama, "on", features=FeatureIntents(cpu_kernels=FeatureMode.OFF))
    assert engine.step_loop.runner.cache.kernels == "pure-torch reference kernels (cpu-kernels realized off)"
    built = {f.name: f for f in engine.realized.features}
    assert not built["cpu-kernels"].realized and built["prefix-caching"].realized


@pytest.mark.parametrize("mode", ["on", "off"])
def test_realized_cpu_kernels_run_every_projection_norm_and_the_lm_head_in_c(make_engine, tiny_llama, mode):
    on = make_engine(tiny_llama, mode)
    off = make_engine(tiny_llama, mode, features=FeatureIntents(cpu_kernels=FeatureMode.OFF))
    for engine, in_c in ((on, True), (off, False)):
        model = engine.step_loop.runner.model
        layer = model.model.layers[-1]
        projections = (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
        norms = (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm)
        for kernel in (*(p.matmul for p in projections), model.head_matmul, *(n.norm for n in norms)):
            assert isinstance(getattr(kernel, "__self__", None), cpu_paged.CpuPagedOps) is in_c
    # the same greedy tokens either way (the parity tests hold both against transformers)
    prompt = tuple(range(5, 30))
    (a,), (b,) = on.run([greedy("c", prompt, 12)], timeout=60), off.run([greedy("t", prompt, 12)], timeout=60)
    assert a.token_ids == b.token_ids


@pytest.fixture(scope="module")
def tiny_llama_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tied"), tie_word_embeddings=True)


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_llama_tied"])
def test_on_a_build_with_panels_every_projection_and_the_lm_head_are_packed_once_and_compute_what_torch_does(
    make_engine, request, mode, model
):
    ops = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(ops, str)
    if not ops.panel_width:
        pytest.skip("this build packs no weights (kvp_panel_width 0: the CPU has neither AVX-512 nor AVX2)")
    model_dir = request.getfixturevalue(model)
    on = make_engine(model_dir, mode)
    off = make_engine(model_dir, mode, features=FeatureIntents(cpu_kernels=FeatureMode.OFF))
    packed_model, torch_model = (e.step_loop.runner.model for e in (on, off))
    for mine, theirs in zip(packed_model.model.layers, torch_model.model.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            packed, plain = mine.get_submodule(name), theirs.get_submodule(name)
            assert packed.packed and not plain.packed
            assert torch.equal(packed.weight, ops.pack(plain.weight)), name
    # the LM head too: its own Linear, or (tied) the embedding's table, which lookups then read packed
    head = "lm_head" if torch_model.lm_head is not None else "model.embed_tokens"
    assert (head == "lm_head") is (model == "tiny_llama")
    want = ops.pack(torch_model.get_submodule(head).weight)
    assert torch.equal(packed_model.get_submodule(head).weight, want)
    assert packed_model.head_matmul.__func__ is cpu_paged.CpuPagedOps.packed_linear  # type: ignore[attr-defined]
    if head == "model.embed_tokens":  # lookups in the packed table: the same rows, the same refusals
        ids = torch.tensor([0, 5, 31, 32, 383])
        assert torch.equal(packed_model.model.embed_tokens(ids), torch_model.model.embed_tokens(ids))
        for bad in (-1, 384):
            with pytest.raises(IndexError, match="out of range"):
                packed_model.model.embed_tokens(torch.tensor([3, bad]))
    # the weights held once: each packed layout replaced [out, in], it was not added beside it
    counts = [sum(p.numel() for p in m.parameters()) for m in (packed_model, torch_model)]
    assert counts[0] == counts[1]
    # what the startup log says was packed (2 layers x 4 projections), and nothing without the kernels
    fresh = [engine_setup.load_model(model_dir, device="cpu", dtype=torch.float32).model for _ in range(2)]
    want = f"8 projections and the LM head in panels of {ops.panel_width} (float32)"
    assert engine_setup.use_cpu_kernels(fresh[0], True) == want
    assert (
        engine_setup.use_cpu_kernels(fresh[1], False) == ""
        and not fresh[1].model.layers[0].mlp.down_proj.packed
    )
    # a prompt of more rows than the small batch: its prefill runs the packed kernel too, then decodes
    prompt = tuple(range(5, 5 + cpu_paged.SMALL_BATCH_ROWS + 36))
    (a,), (b,) = on.run([greedy("c", prompt, 12)], timeout=60), off.run([greedy("t", prompt, 12)], timeout=60)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_llama_tied"])
def test_a_bfloat16_model_packs_its_projections_and_lm_head_in_pairs_and_computes_what_torch_does(
    request, model
):
    # --dtype bfloat16 on the C kernels: the same packing, in pairs (kernels/cpu_paged.py `pack`); each
    # projection, the LM head and the tied table's lookups give torch's bfloat16 results (the exact
    # product rounded once, as torch's bf16 matmul rounds it)
    ops = cpu_paged.load(torch.float32, torch.device("cpu"))
    assert not isinstance(ops, str)
    if not ops.panel_width:
        pytest.skip("this build packs no weights (kvp_panel_width 0: the CPU has neither AVX-512 nor AVX2)")
    model_dir = request.getfixturevalue(model)
    packed_model, torch_model = (
        engine_setup.load_model(model_dir, device="cpu", dtype=torch.bfloat16).model for _ in range(2)
    )
    want = f"8 projections and the LM head in panels of {ops.panel_width} (bfloat16 pairs)"
    assert engine_setup.use_cpu_kernels(packed_model, True) == want
    gen = torch.Generator().manual_seed(3)
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for mine, theirs in zip(packed_model.model.layers, torch_model.model.layers, strict=True):
        for name in names:
            packed, plain = mine.get_submodule(name), theirs.get_submodule(name)
            assert packed.packed and packed.weight.dtype is torch.bfloat16
            x = torch.randn(5, plain.in_features, generator=gen).bfloat16()
            torch.testing.assert_close(packed(x).float(), plain(x).float(), rtol=2**-7, atol=1e-3)
    hidden = torch.randn(3, torch_model.config.hidden_size, generator=gen).bfloat16()
    logits = packed_model.compute_logits(hidden), torch_model.compute_logits(hidden)
    torch.testing.assert_close(*logits, rtol=2**-7, atol=1e-3)
    ids = torch.tensor([0, 5, 31, 32, 383])
    assert (packed_model.model.embed_tokens.panel > 0) is (
        model == "tiny_llama_tied"
    )  # the tied table packed
    assert torch.equal(packed_model.model.embed_tokens(ids), torch_model.model.embed_tokens(ids))
    # the norms stay the model's own (their variance in float32; torch.rms_norm's in bfloat16 changed
    # the SmolLM2 answers), bit for bit
    x = (10 * torch.randn(4, torch_model.config.hidden_size, generator=gen)).bfloat16()
    for mine, theirs in zip(packed_model.model.layers, torch_model.model.layers, strict=True):
        assert torch.equal(mine.input_layernorm(x), theirs.input_layernorm(x))
