"""Each optional feature's intent, through the real pre-load checks (startup/checks.py) and, where the
build decides, the real build: auto realizes off naming the reason, on fails naming it, off never."""

from __future__ import annotations

import pytest
import torch

from kvpact.kernels import cpu_paged
from kvpact.shared.errors import FeatureRequiredError
from kvpact.shared.features import FeatureIntents, FeatureMode, FeatureState
from kvpact.worker.loader.header import read_model_header
from kvpact.worker.startup import checks, engine_setup
from tests.factories.tiny_models import make_tiny_llama
from tests.worker.conftest import worker_spec
from tests.worker.test_engine_setup import h200_probe, no_loading  # noqa: F401 - a fixture

AUTO, ON, OFF = FeatureMode.AUTO, FeatureMode.ON, FeatureMode.OFF
GiB = 2**30
pytestmark = pytest.mark.usefixtures("no_loading")  # no check here may read a weight


@pytest.fixture(scope="module")
def head64(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A model the Triton kernels take (head size 64), for the described GPU."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("head64"), hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64
    )


def plan(model, mode="auto", probe=None, **features):  # type: ignore[no-untyped-def]
    spec = worker_spec(model, mode, features=FeatureIntents(**features))
    return engine_setup.plan_startup(spec, probe=probe)


def state(p, name: str) -> FeatureState:  # type: ignore[no-untyped-def]
    (found,) = [f for f in p.features if f.name == name]
    return found


def test_every_feature_is_planned_in_order_and_defaults_to_auto(tiny_llama):
    p = plan(tiny_llama)
    assert [f.name for f in p.features] == [
        "paged-attn", "prefix-caching", "cpu-kernels", "quant-kernels", "cuda-graphs"
    ]  # fmt: skip
    assert all(f.requested is AUTO for f in p.features)


# ---- prefix-caching ----


def test_prefix_caching_auto_on_the_eager_cache_realizes_off_naming_why(tiny_llama):
    s = state(plan(tiny_llama, "auto"), "prefix-caching")
    assert (s.realized, s.code, s.component) == (False, "prefix-cache-needs-paged", "cache")
    assert s.message.startswith("prefix caching needs the paged KV cache and this worker plans an eager one")
    assert "eager is the CPU default" in s.message


def test_prefix_caching_on_never_turns_paged_attention_on(tiny_llama):
    with pytest.raises(FeatureRequiredError) as info:
        plan(tiny_llama, "auto", prefix_caching=ON)
    assert info.value.feature == "prefix-caching" and info.value.component == "cache"
    assert str(info.value).startswith(
        "Prefix caching was explicitly requested (--prefix-caching on), but prefix caching needs the paged KV"
    )
    with pytest.raises(FeatureRequiredError, match=r"\(--paged-attn off\)"):
        plan(tiny_llama, "off", prefix_caching=ON)


def test_prefix_caching_on_with_the_paged_cache_is_realized_and_off_is_off(tiny_llama):
    assert state(plan(tiny_llama, "on", prefix_caching=ON), "prefix-caching").realized
    off = state(plan(tiny_llama, "on", prefix_caching=OFF), "prefix-caching")
    assert (off.realized, off.code, off.message) == (
        False,
        "off-by-request",
        "it was started with --prefix-caching off",
    )


# ---- cpu-kernels ----


def test_cpu_kernels_auto_on_a_float32_cpu_cache_is_realized(tiny_llama):
    assert state(plan(tiny_llama, "auto", cpu_kernels=ON), "cpu-kernels").realized


def test_cpu_kernels_take_a_float32_or_bfloat16_cache_and_refuse_float16(tiny_llama):
    bf16 = worker_spec(tiny_llama, "on", cache_dtype=engine_setup.CacheDtype.BFLOAT16)
    assert state(engine_setup.plan_startup(bf16), "cpu-kernels").realized
    spec = worker_spec(tiny_llama, "on", cache_dtype=engine_setup.CacheDtype.FLOAT16)
    s = state(engine_setup.plan_startup(spec), "cpu-kernels")
    assert (s.realized, s.code) == (False, "c-kernels-need-float32-or-bfloat16")
    assert s.message == "the C kernels take a float32 or bfloat16 KV cache and this one is float16"
    on = worker_spec(
        tiny_llama,
        "on",
        cache_dtype=engine_setup.CacheDtype.FLOAT16,
        features=FeatureIntents(cpu_kernels=ON),
    )
    with pytest.raises(
        FeatureRequiredError, match=r"--cpu-kernels on\), but the C kernels take a float32 or bfloat16 KV"
    ):
        engine_setup.plan_startup(on)


def test_cpu_kernels_without_a_c_compiler_fall_back_under_auto_and_fail_under_on(
    tiny_llama, monkeypatch, tmp_path
):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVPACT_CACHE_DIR", str(tmp_path / "cache"))
    s = state(plan(tiny_llama), "cpu-kernels")
    assert (s.realized, s.code, s.component) == (False, "c-kernels-build", "build")
    assert s.message.startswith("the C kernels cannot be built here: could not build cpu_paged.c")
    with pytest.raises(FeatureRequiredError, match="the C kernels cannot be built here") as info:
        plan(tiny_llama, cpu_kernels=ON)
    assert info.value.feature == "cpu-kernels"


def test_cpu_kernels_on_a_gpu_cache_name_the_device(head64, monkeypatch):
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: None)
    s = state(plan(head64, probe=h200_probe(8 * GiB)), "cpu-kernels")
    assert (s.realized, s.code, s.message) == (
        False,
        "c-kernels-need-cpu",
        "the C kernels run on CPU tensors and this worker's KV cache is on cuda",
    )


# ---- quant-kernels ----


@pytest.fixture(scope="module")
def q4_1_gguf(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A tiny Q4_1 GGUF, as the bundled model is stored: quant-kernels can realize."""
    from tests.factories.tiny_models import make_tiny_gguf

    return make_tiny_gguf(tmp_path_factory.mktemp("q4_1") / "model.gguf", file_type="q4_1")


def test_quant_kernels_are_planned_for_a_q4_1_gguf_and_name_why_not_elsewhere(tiny_llama, q4_1_gguf):
    if not cpu_paged.load(torch.float32, torch.device("cpu")).quant_max_rows:  # type: ignore[union-attr]
        pytest.skip("this build packs no weights (no AVX-512 or AVX2)")
    assert state(plan(q4_1_gguf, quant_kernels=ON), "quant-kernels").realized
    s = state(plan(tiny_llama), "quant-kernels")  # a safetensors checkpoint
    assert (s.realized, s.code, s.component, s.message) == (
        False,
        "quant-kernels-storage",
        "loader",
        "the decoder projections are stored as safetensors, not Q4_1 in a GGUF file",
    )
    with pytest.raises(FeatureRequiredError) as info:
        plan(tiny_llama, quant_kernels=ON)
    assert str(info.value) == (
        "The quantized (Q4_1 / Q8_0) kernels were explicitly requested (--quant-kernels on), but the decoder "
        "projections are stored as safetensors, not Q4_1 in a GGUF file. [loader]"
    )


def test_the_weights_memory_counts_quant_kernels_copies_wherever_they_may_be_made(q4_1_gguf):
    if not cpu_paged.load(torch.float32, torch.device("cpu")).quant_max_rows:  # type: ignore[union-attr]
        pytest.skip("this build packs no weights (no AVX-512 or AVX2)")
    header = read_model_header(q4_1_gguf)
    float32 = 4 * header.weight_numel
    # the projections' Q4_1 panels at 6 bits a weight, the head's Q8_0 ones at 9
    copies = header.projection_numel * 6 // 8 + header.head_numel * 9 // 8
    assert header.projection_numel and header.head_storage == "Q8_0"
    assert plan(q4_1_gguf).weight_bytes == float32 + copies
    for off in ({"quant_kernels": OFF}, {"cpu_kernels": OFF}):
        assert plan(q4_1_gguf, **off).weight_bytes == float32
    spec = worker_spec(q4_1_gguf, "auto", dtype="bfloat16")  # no copies of a bfloat16 model
    assert engine_setup.plan_startup(spec).weight_bytes == float32 // 2


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (
            {"cpu_kernels": OFF},
            "quant-kernels-need-cpu-kernels",
            "the GGUF's quantized weights are read by the C kernels and cpu-kernels is off here "
            "(--cpu-kernels off)",
        ),
        (
            {"dtype": "bfloat16"},
            "quant-kernels-dtype",
            "the model runs in bfloat16 and the quantized kernels read a float32 model's exact GGUF values",
        ),
    ],
    ids=["cpu-kernels-off", "bfloat16"],
)
def test_quant_kernels_on_fail_before_loading_naming_what_they_need(q4_1_gguf, flags, code, message):
    dtype = flags.pop("dtype", "auto")
    spec = worker_spec(q4_1_gguf, "auto", dtype=dtype, features=FeatureIntents(quant_kernels=ON, **flags))
    with pytest.raises(FeatureRequiredError) as info:
        engine_setup.plan_startup(spec)
    assert (info.value.feature, info.value.code) == ("quant-kernels", code)
    assert message in str(info.value)
    auto = worker_spec(q4_1_gguf, "auto", dtype=dtype, features=FeatureIntents(**flags))
    s = state(engine_setup.plan_startup(auto), "quant-kernels")
    assert (s.realized, s.code, s.message) == (False, code, message)


# ---- cuda-graphs ----


def test_cuda_graphs_on_cpu_realize_off_under_auto_and_fail_under_on(tiny_llama):
    s = state(plan(tiny_llama), "cuda-graphs")
    assert (s.realized, s.code, s.component) == (False, "no-cuda-device", "device")
    with pytest.raises(FeatureRequiredError) as info:
        plan(tiny_llama, cuda_graphs=ON)
    assert str(info.value) == (
        "CUDA graphs were explicitly requested (--cuda-graphs on), but no CUDA device: CUDA graphs need one "
        "and this worker runs on cpu. [device]"
    )


def test_cuda_graphs_on_a_gpu_with_the_triton_paged_cache_are_planned(head64, monkeypatch):
    """Planned on; the capture and its parity check run after loading (tests/worker/test_decode_graphs.py)."""
    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: None)
    s = state(plan(head64, probe=h200_probe(8 * GiB)), "cuda-graphs")
    assert (s.realized, s.code) == (True, "")


@pytest.mark.parametrize(
    ("mode", "paged", "what"),
    [
        ("on", {"backend": "torch"}, "the torch paged backend (--pa-backend torch)"),
        ("off", {}, "an eager KV cache (--paged-attn off)"),
    ],
    ids=["torch-backend", "eager"],
)
def test_cuda_graphs_need_the_triton_paged_cache(head64, monkeypatch, mode, paged, what):
    from kvpact.shared.intent import PagedBackend

    monkeypatch.setattr(checks, "triton_self_test", lambda *a, **k: None)
    settings = {k: PagedBackend(v) for k, v in paged.items()}

    def planned(graphs: FeatureMode):  # type: ignore[no-untyped-def]
        spec = worker_spec(head64, mode, features=FeatureIntents(cuda_graphs=graphs), **settings)
        return engine_setup.plan_startup(spec, probe=h200_probe(8 * GiB))

    s = state(planned(AUTO), "cuda-graphs")
    assert (s.realized, s.code, s.component) == (False, "cuda-graphs-need-triton-paged", "cache")
    assert s.message == f"CUDA graphs capture the Triton paged decode step and this worker plans {what}"
    with pytest.raises(FeatureRequiredError, match="--cuda-graphs on"):
        planned(ON)
