"""Small decode steps through every decoder layer in one C call (worker/engine/fused_decode.py): which
steps take it, and that they compute what the model's layer-by-layer forward computes (same tokens,
logits within float32 rounding), on both caches, with no biases, q/k/v biases (Qwen2) and q/k/v and output
biases (Llama's attention_bias)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpact.kernels import cpu_paged
from kvpact.shared.features import FeatureIntents, FeatureMode
from kvpact.worker.engine.engine import Engine
from kvpact.worker.startup import engine_setup
from tests.factories.tiny_models import make_tiny_gguf, make_tiny_llama, make_tiny_qwen2
from tests.worker.conftest import greedy, paced_steps, run_staggered
from tests.worker.test_parity import record_logits

LOGITS_ATOL = 1e-4  # measured ~1e-6: RoPE's fused multiply-adds and the C SiLU's exp round differently


def fused_rows(engine: Engine) -> list[int]:
    """The row count of every step the C decode layers ran, recorded as the engine steps. A step of at
    most SMALL_BATCH_ROWS rows (decodes, prompt chunks or both) that they declined fails the test at once:
    they must take every one."""
    fused = engine.step_loop.runner.fused
    assert fused is not None, "the C decode layers were not installed"
    ran: list[int] = []
    run = fused.run

    def spy(input_ids, positions, attn):  # type: ignore[no-untyped-def]
        hidden = run(input_ids, positions, attn)
        rows = input_ids.shape[0]
        if hidden is not None:
            ran.append(rows)
        elif rows <= cpu_paged.SMALL_BATCH_ROWS:
            raise AssertionError(f"a step of {rows} rows did not run the C decode layers")
        return hidden

    fused.run = spy  # type: ignore[method-assign]
    return ran


def prompts(count: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(3, 384, (5 + 9 * i,), generator=gen).tolist()) for i in range(count)]


def generate(
    engine: Engine, count: int, new_tokens: int
) -> tuple[list[list[int]], dict[str, list[torch.Tensor]]]:
    logits = record_logits(engine)
    requests = [greedy(f"r{i}", p, new_tokens) for i, p in enumerate(prompts(count))]
    results = engine.run(requests, timeout=120)
    return [r.token_ids for r in results], logits


def assert_fused_computes_what_the_layers_compute(fused: Engine, plain: Engine) -> None:
    """4 greedy requests of 12 tokens on each engine, `plain` running the model's own forward for every
    step: the same tokens, logits within LOGITS_ATOL, every decodes-only step in C (`fused_rows`), several
    sequences in some of them (how many decode together is the step loop's timing: on a loaded machine
    the four are admitted over several steps; two CI runs saw 6 and 9 steps of all four)."""
    plain.step_loop.runner.fused = None
    ran = fused_rows(fused)
    tokens, logits = generate(fused, 4, 12)
    want_tokens, want_logits = generate(plain, 4, 12)
    assert tokens == want_tokens
    for rid, rows in want_logits.items():
        torch.testing.assert_close(torch.stack(logits[rid]), torch.stack(rows), atol=LOGITS_ATOL, rtol=0)
    # the last one admitted decodes its 11 steps after its prefill, with no prefill beside them
    assert max(ran, default=0) > 1 and len(ran) >= 11, ran


@pytest.fixture(scope="module")
def tiny_llama_biased(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with attention_bias: the q/k/v and the output projections both have biases."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-biased"), attention_bias=True)


@pytest.mark.parametrize("mode", ["on", "off"], ids=["paged", "eager"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_llama_biased"])
def test_fused_decode_computes_what_the_layers_compute(make_engine, request, mode, model):
    model_dir = request.getfixturevalue(model)
    fused, plain = make_engine(model_dir, mode), make_engine(model_dir, mode)
    assert_fused_computes_what_the_layers_compute(fused, plain)
    stats = fused.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("mode", ["on", "off"], ids=["paged", "eager"])
def test_prompt_chunks_beside_decodes_run_in_c_over_their_cached_prefix(make_engine, tiny_llama, mode):
    """Prompts of 23-50 tokens arriving while others decode, at most 3 prompt tokens beside the decodes: each
    prompt is prefilled in chunks that attend over the part already in the cache, in the same steps as
    the decodes. Both run in the C call (a chunk's tokens as rows of their own context) and compute
    what the model's own forward computes, with the paged cache's shared prefix blocks too."""
    fused, plain = (make_engine(tiny_llama, mode, prompt_tokens_beside_decodes=3) for _ in range(2))
    plain.step_loop.runner.fused = None
    steps: list[tuple[int, int]] = []  # C steps with both: (decode rows, prompt rows past their start)
    run = fused.step_loop.runner.fused.run  # type: ignore[union-attr]

    def spy(input_ids, positions, attn):  # type: ignore[no-untyped-def]
        hidden = run(input_ids, positions, attn)
        rows, decodes = input_ids.shape[0], attn.num_decodes
        assert hidden is not None or rows > cpu_paged.SMALL_BATCH_ROWS, f"a {rows}-row step was not in C"
        if 0 < decodes < rows:
            steps.append((decodes, int((positions[decodes:] > 0).sum())))
        return hidden

    fused.step_loop.runner.fused.run = spy  # type: ignore[union-attr,method-assign]
    shared = prompts(4)[3][:20]  # a shared 20-token prefix: cached blocks on the paged cache
    requests = [greedy(f"r{i}", shared + p[: 3 + 10 * i], 8) for i, p in enumerate(prompts(4))]
    results = {}
    for engine in (fused, plain):
        paced_steps(engine, 0.004)
        logits = record_logits(engine)
        tokens = [r.token_ids for r in run_staggered(engine, requests, gap_s=0.02)]
        results[engine is fused] = tokens, logits
    assert results[True][0] == results[False][0]
    for rid, rows in results[False][1].items():
        torch.testing.assert_close(
            torch.stack(results[True][1][rid]), torch.stack(rows), atol=LOGITS_ATOL, rtol=0
        )
    assert steps and max(prompt for _, prompt in steps) > 0, steps


SMOLLM_SHAPES = {
    "hidden_size": 576,
    "num_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
}


@pytest.fixture(scope="module")
def smollm_shaped_q4_1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's shapes, 2 layers, in a Q4_1 GGUF as the bundled file is: its projections load
    as float32 holding exactly Q4_1 values (its embedding, the tied head, Q8_0 ones), so decode steps of
    a few sequences read Q4_1 panels and their logits Q8_0 ones."""
    path = tmp_path_factory.mktemp("smollm-q4_1") / "model.gguf"
    return make_tiny_gguf(path, file_type="q4_1", std=0.05, **SMOLLM_SHAPES)


@pytest.mark.parametrize("mode", ["on", "off"], ids=["paged", "eager"])
def test_a_q4_1_model_decodes_its_small_steps_on_q4_1_panels_computing_what_the_layers_compute(
    make_engine, smollm_shaped_q4_1, mode
):
    fused, plain = make_engine(smollm_shaped_q4_1, mode), make_engine(smollm_shaped_q4_1, mode)
    assert fused.step_loop.runner.fused is not None
    if not cpu_paged.load(torch.float32, torch.device("cpu")).quant_max_rows:  # type: ignore[union-attr]
        pytest.skip("this build packs no weights (no AVX-512 or AVX2)")
    assert fused.step_loop.runner.fused.q4.startswith("yes: 8 projections, for steps of up to")
    assert "quant-kernels" in {f.name for f in fused.realized.features if f.realized}
    # the tied head, the file's Q8_0 embedding, reads its Q8_0 panels for the few rows a step samples
    assert "small_rows_linear" in fused.step_loop.runner.model.head_matmul.__qualname__
    assert_fused_computes_what_the_layers_compute(fused, plain)  # 4 sequences at most: all quantized


def test_quant_kernels_off_packs_no_quantized_copy(make_engine, smollm_shaped_q4_1):
    """--quant-kernels off on a Q4_1 GGUF: the layers and the head keep their float32 panels alone."""
    engine = make_engine(smollm_shaped_q4_1, "on", features=FeatureIntents(quant_kernels=FeatureMode.OFF))
    runner = engine.step_loop.runner
    assert runner.fused is not None and runner.fused.q4 == "no: quant-kernels off"
    assert not runner.fused.q4_copies
    assert "small_rows_linear" not in runner.model.head_matmul.__qualname__


@pytest.fixture(scope="module")
def smollm_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's layer shapes (hidden 576, 9 heads of 64, 3 KV heads, intermediate 1536), 2
    layers: the sizes the C code inlines, and large enough that its linear (gate_up) and its decode (4
    contexts of ~300 tokens) split over threads where torch has more than one."""
    return make_tiny_llama(tmp_path_factory.mktemp("smollm-shaped"), std=0.05, **SMOLLM_SHAPES)


@pytest.mark.parametrize("mode", ["on", "off"], ids=["paged", "eager"])
def test_at_the_default_models_shapes_the_c_layers_compute_what_the_layers_compute(
    make_engine, smollm_shaped, mode
):
    fused, plain = (
        make_engine(smollm_shaped, mode, max_model_len=512),
        make_engine(smollm_shaped, mode, max_model_len=512),
    )
    plain.step_loop.runner.fused = None
    ran = fused_rows(fused)
    # a safetensors model: quant-kernels realized off before loading, so no Q4_1 panels are tried
    assert fused.step_loop.runner.fused.q4 == "no: quant-kernels off"  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(11)
    long_prompts = [tuple(torch.randint(3, 384, (290 + 7 * i,), generator=gen).tolist()) for i in range(4)]
    got, want = (
        (record_logits(e), e.run([greedy(f"r{i}", p, 6) for i, p in enumerate(long_prompts)], timeout=120))
        for e in (fused, plain)
    )
    assert [r.token_ids for r in got[1]] == [r.token_ids for r in want[1]]
    for rid, rows in want[0].items():
        torch.testing.assert_close(torch.stack(got[0][rid]), torch.stack(rows), atol=LOGITS_ATOL, rtol=0)
    # the last one admitted decodes its 5 steps after its prefill, with no prefill beside them
    assert max(ran, default=0) > 1 and len(ran) >= 5, ran


def test_more_sequences_than_the_small_batch_run_the_model(make_engine, tiny_llama):
    over = cpu_paged.SMALL_BATCH_ROWS + 1
    engine = make_engine(tiny_llama, "on", max_num_seqs=over)
    fused = engine.step_loop.runner.fused
    assert fused is not None
    calls: list[tuple[int, bool]] = []  # (rows, whether the C decode layers ran the step)
    run = fused.run

    def spy(input_ids, positions, attn):  # type: ignore[no-untyped-def]
        hidden = run(input_ids, positions, attn)
        calls.append((input_ids.shape[0], hidden is not None))
        return hidden

    fused.run = spy  # type: ignore[method-assign]
    # short prompts, all prefilled in the first step, so every sequence decodes in the same steps
    requests = [greedy(f"r{i}", p[:5], 6) for i, p in enumerate(prompts(over))]
    results = engine.run(requests, timeout=120)
    assert [len(r.token_ids) for r in results] == [6] * over
    large = [ran for rows, ran in calls if rows > cpu_paged.SMALL_BATCH_ROWS]
    assert large, f"no decode step had more than {cpu_paged.SMALL_BATCH_ROWS} sequences: {calls}"
    assert not any(large), f"steps of {over} sequences ran the C decode layers: {calls}"


def test_cpu_kernels_off_installs_no_c_decode_layers(make_engine, tiny_llama):
    for mode in ("on", "off"):
        engine = make_engine(tiny_llama, mode, features=FeatureIntents(cpu_kernels=FeatureMode.OFF))
        assert engine.step_loop.runner.fused is None


def test_on_a_bfloat16_cache_the_c_layers_compute_what_the_layers_compute(make_engine, tiny_llama):
    # --pa-cache-dtype bfloat16 under float32 weights: the C kernels (packed projections, the decode
    # layers) run on it; the decode layers round each new K/V row to bfloat16 as the layer-by-layer
    # write does, so both paths read the same cache.
    bf16 = engine_setup.CacheDtype.BFLOAT16
    fused, plain = (
        make_engine(tiny_llama, "on", cache_dtype=bf16),
        make_engine(tiny_llama, "on", cache_dtype=bf16),
    )
    assert fused.step_loop.runner.cache.key[0].dtype is torch.bfloat16
    assert fused.step_loop.runner.cache.cpu_kernels
    assert_fused_computes_what_the_layers_compute(fused, plain)


BF16_LOGITS_ATOL = 0.3  # measured 0.09-0.17 on logits of magnitude 5-7, the layer-by-layer path alike


@pytest.mark.parametrize("mode", ["on", "off"], ids=["paged", "eager"])
@pytest.mark.parametrize("maker", [make_tiny_llama, make_tiny_qwen2], ids=["llama", "qwen2"])
def test_a_bfloat16_model_runs_the_c_layers_on_its_packed_weights_as_near_float32_as_its_layers(
    make_engine, tmp_path, maker, mode
):
    # --dtype bfloat16 on the C kernels: its packed bf16 projections in the C decode layers, the stream
    # between them in float32; the layer-by-layer path rounds every op to bf16. Neither is float32 (the
    # same weights, widened): each is held to it over the steps before its tokens leave float32's.
    model_dir = maker(tmp_path, dtype=torch.bfloat16)
    fused, plain, exact = (make_engine(model_dir, mode, dtype=d) for d in ("bfloat16", "bfloat16", "float32"))
    assert fused.step_loop.runner.fused is not None
    assert fused.step_loop.runner.model.model.layers[0].mlp.down_proj.weight.dtype is torch.bfloat16
    plain.step_loop.runner.fused = None
    ran = fused_rows(fused)
    want_tokens, want_logits = generate(exact, 4, 12)
    for engine in (fused, plain):
        tokens, logits = generate(engine, 4, 12)
        compared = 0
        for i, rid in enumerate(sorted(want_logits)):
            pairs = zip(tokens[i], want_tokens[i], strict=True)
            agree = next((k for k, (a, b) in enumerate(pairs) if a != b), 12)
            steps = min(agree + 1, 12)  # the step that chose differently saw the same tokens
            got, want = torch.stack(logits[rid][:steps]), torch.stack(want_logits[rid][:steps])
            torch.testing.assert_close(got, want, atol=BF16_LOGITS_ATOL, rtol=0)
            compared += steps
        assert compared >= 24, f"tokens left float32's too early to compare: {compared} steps"
    # the last one admitted decodes its 11 steps after its prefill, with no prefill beside them
    assert max(ran, default=0) > 1 and len(ran) >= 11, ran


@pytest.mark.parametrize("mode", [FeatureMode.AUTO, FeatureMode.ON], ids=["auto", "on"])
def test_quant_kernels_whose_loaded_values_are_not_q4_1_fall_back_after_loading(tiny_llama, mode):
    """The one check after loading: every projection's values. Planned as if the file's header had said
    Q4_1 (this model is float32 safetensors): auto builds the worker without the panels, naming the
    first projection that is not Q4_1; on fails startup naming it."""
    from kvpact.shared.errors import FeatureRequiredError
    from kvpact.shared.features import FeatureState
    from tests.worker.conftest import worker_spec

    if not cpu_paged.load(torch.float32, torch.device("cpu")).quant_max_rows:  # type: ignore[union-attr]
        pytest.skip("this build packs no weights (no AVX-512 or AVX2)")
    plan = engine_setup.plan_startup(worker_spec(tiny_llama, "on"))
    plan.features = tuple(
        f if f.name != "quant-kernels" else FeatureState("quant-kernels", mode, True) for f in plan.features
    )
    why = (
        "the loaded weights cannot be packed as Q4_1: layer 0's qkv projection does not hold exactly Q4_1 "
        "values"
    )
    if mode is FeatureMode.ON:
        with pytest.raises(FeatureRequiredError, match=r"--quant-kernels on\), but " + why) as info:
            engine_setup.build_engine(plan)
        assert info.value.code == "quant-kernels-values"
        return
    engine = engine_setup.build_engine(plan)
    try:
        (s,) = [f for f in engine.realized.features if f.name == "quant-kernels"]
        assert (s.realized, s.code, s.message) == (False, "quant-kernels-values", why)
        assert engine.step_loop.runner.fused is not None and not engine.step_loop.runner.fused.q4_copies
    finally:
        engine.close()
