"""The contract's regression cases (docs/design.md, "The contract"), one named test each, plus the decisions
around them."""

import pytest

from kvpact.shared import reasons
from kvpact.shared.capability import DeviceInfo, KernelSupport, ModelTraits, choose_backend
from kvpact.shared.errors import PagedAttentionRequiredError
from kvpact.shared.features import FeatureMode, FeatureState, Ledger
from kvpact.shared.intent import (
    CacheIntent,
    PagedAttentionConfig,
    PagedAttentionMode,
    PagedBackend,
    cache_intent,
    paged_config_for_mode,
)
from kvpact.shared.reasons import PAGED_ATTN
from kvpact.shared.scheduler_choice import CacheKind, select_scheduler

H100_SUPPORT = KernelSupport(
    head_sizes=frozenset({64, 128}),
    block_sizes=frozenset({16, 32}),
    dtypes=frozenset({"float16", "bfloat16", "float32"}),
    min_compute_capability=(8, 0),
)
CUDA = DeviceInfo(
    kind="cuda", name="H100", compute_capability=(9, 0), triton_version="3.9.0", triton_support=H100_SUPPORT
)
CPU = DeviceInfo(kind="cpu")
MPS = DeviceInfo(kind="mps")
SMOL = ModelTraits(head_size=64, dtype="bfloat16")


class Paged:
    """paged-attn while a worker starts: the intent, and the ledger whose door it falls back through."""

    def __init__(self, mode: str, **settings: object) -> None:
        self.intent = cache_intent(PagedAttentionMode(mode), PagedAttentionConfig(**settings))  # type: ignore[arg-type]
        self.ledger = Ledger({PAGED_ATTN: FeatureMode(mode)})

    @property
    def config(self) -> PagedAttentionConfig | None:  # as worker/startup/checks.py's Planning derives it
        return self.intent.paged if self.ledger.in_force(PAGED_ATTN) else None

    @property
    def required(self) -> bool:
        return self.intent.required

    @property
    def fallbacks(self) -> list[tuple[str, str]]:
        return [(f.component, f.message) for f in self.ledger.findings.values()]

    def feature_state(self) -> FeatureState:
        return self.ledger.state(PAGED_ATTN)


def state(mode: str, **settings: object) -> Paged:
    return Paged(mode, **settings)


def decide(device: DeviceInfo, s: Paged, model: ModelTraits | None = None) -> PagedBackend | None:
    """The device check as startup runs it (worker/startup/checks.py): only while the config is in force,
    its finding through the door. The backend, or None when paged-attn realizes off."""
    if s.config is None:
        return None
    backend, finding = choose_backend(device, s.config, s.intent.required, model)
    if finding is not None:
        s.ledger.fall_back(PAGED_ATTN, finding)
    return backend


def test_cli_mapping_of_auto_on_off():
    assert paged_config_for_mode(PagedAttentionMode.AUTO) == PagedAttentionConfig()
    assert paged_config_for_mode(PagedAttentionMode.ON) == PagedAttentionConfig()
    assert paged_config_for_mode(PagedAttentionMode.OFF) is None
    # "required" is the mode's, one form: derived, never stored beside it
    assert [cache_intent(m).required for m in PagedAttentionMode] == [False, True, False]


def test_default_and_required_config_construction():
    default = PagedAttentionConfig()
    assert default.block_size == 16
    assert default.backend is PagedBackend.AUTO
    required = paged_config_for_mode(
        PagedAttentionMode.ON, PagedAttentionConfig(block_size=32, context_tokens=4096)
    )
    assert required == PagedAttentionConfig(block_size=32, context_tokens=4096)


def test_config_rejects_two_budgets_naming_the_flags():
    with pytest.raises(Exception, match="--pa-memory-fraction, --pa-memory-bytes and --pa-context-tokens"):
        PagedAttentionConfig(memory_bytes=1, context_tokens=2)


def test_intent_keeps_the_paged_config_tied_to_mode():
    with pytest.raises(ValueError):
        CacheIntent(mode=PagedAttentionMode.ON, paged=None)
    with pytest.raises(ValueError):
        CacheIntent(mode=PagedAttentionMode.OFF, paged=PagedAttentionConfig())


def test_auto_fallback_records_reason_at_the_door():
    s = state("auto")
    s.ledger.fall_back(PAGED_ATTN, reasons.MIXED_DEVICE_MAP.found())
    assert s.config is None and not s.ledger.in_force(PAGED_ATTN)
    assert s.fallbacks == [("device", "device mapping includes CPU and PagedAttention has no CPU KV cache")]
    realized = s.feature_state()
    assert (realized.realized, realized.code, realized.component) == (False, "mixed-device-map", "device")
    s.ledger.fall_back(PAGED_ATTN, reasons.NO_TRITON.found())  # the door takes one: the first stays
    assert s.fallbacks == [("device", "device mapping includes CPU and PagedAttention has no CPU KV cache")]


def test_required_failure_at_the_door_names_flag_and_reason():
    s = state("on")
    with pytest.raises(PagedAttentionRequiredError) as err:
        s.ledger.fall_back(PAGED_ATTN, reasons.MIXED_DEVICE_MAP.found())
    assert str(err.value) == (
        "PagedAttention was explicitly requested (--paged-attn on), but device mapping includes CPU and "
        "PagedAttention has no CPU KV cache. [device]"
    )
    assert (err.value.component, err.value.code) == ("device", "mixed-device-map")
    assert s.ledger.in_force(PAGED_ATTN) and s.config is not None


def test_the_door_after_off_is_a_no_op():
    s = state("off")
    s.ledger.fall_back(PAGED_ATTN, reasons.MIXED_DEVICE_MAP.found())
    assert s.fallbacks == [] and s.config is None


@pytest.mark.parametrize("device", [CPU, MPS], ids=["cpu", "mps"])
def test_cpu_and_mps_behaviour_for_all_three_modes(device):
    auto = state("auto")
    assert decide(device, auto) is None
    realized = auto.feature_state()
    assert not realized.realized and realized.message.startswith(
        f"eager is the {device.kind.upper()} default"
    )
    assert auto.fallbacks[0][0] == "device"

    on = state("on")
    assert decide(device, on) is PagedBackend.TORCH
    assert on.feature_state().realized and on.required

    off = state("off")
    assert decide(device, off) is None
    assert (off.feature_state().code, off.fallbacks) == (reasons.OFF_BY_REQUEST.code, [])


def test_cuda_auto_enables_triton():
    auto = state("auto")
    assert decide(CUDA, auto, SMOL) is PagedBackend.TRITON
    assert auto.feature_state().realized and not auto.required


def test_unsupported_build_without_triton():
    no_triton = DeviceInfo(kind="cuda", name="H100", compute_capability=(9, 0), triton_version=None)
    auto = state("auto")
    assert decide(no_triton, auto, SMOL) is None
    assert "no usable Triton" in auto.fallbacks[0][1]
    with pytest.raises(PagedAttentionRequiredError, match="no usable Triton"):
        decide(no_triton, state("on"), SMOL)


def test_unsupported_build_old_compute_capability():
    old = DeviceInfo(
        kind="cuda",
        name="Tesla P100",
        compute_capability=(6, 0),
        triton_version="3.9.0",
        triton_support=H100_SUPPORT,
    )
    auto = state("auto")
    assert decide(old, auto, SMOL) is None
    assert (
        auto.fallbacks[0][1]
        == "the Triton paged kernels need compute capability >= 8.0 and Tesla P100 has 6.0"
    )
    with pytest.raises(PagedAttentionRequiredError, match="compute capability >= 8.0"):
        decide(old, state("on"), SMOL)


@pytest.mark.parametrize(
    ("settings", "model", "needle"),
    [
        ({"block_size": 8}, SMOL, "not --pa-block-size 8"),
        ({}, ModelTraits(head_size=96, dtype="float16"), "head size 96"),
        ({}, ModelTraits(head_size=64, dtype="float64"), "not float64"),
    ],
)
def test_kernel_limits_are_named_reasons(settings, model, needle):
    auto = state("auto", **settings)
    assert decide(CUDA, auto, model) is None
    assert needle in auto.fallbacks[0][1]
    with pytest.raises(PagedAttentionRequiredError, match=needle):
        decide(CUDA, state("on", **settings), model)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_mixed_cpu_gpu_device_map(mode):
    mixed = DeviceInfo(
        kind="cuda",
        compute_capability=(9, 0),
        triton_version="3.9.0",
        triton_support=H100_SUPPORT,
        device_map_kinds=frozenset({"cuda", "cpu"}),
    )
    s = state(mode)
    if mode == "on":
        with pytest.raises(PagedAttentionRequiredError, match="device mapping includes CPU"):
            decide(mixed, s, SMOL)
    else:
        assert decide(mixed, s, SMOL) is None
        assert s.fallbacks[0][1] == "device mapping includes CPU and PagedAttention has no CPU KV cache"


def test_triton_backend_without_cuda_is_unsupported():
    with pytest.raises(PagedAttentionRequiredError, match="needs a CUDA device and this worker runs on cpu"):
        decide(CPU, state("on", backend=PagedBackend.TRITON))


def test_scheduler_rejects_required_request_without_realized_cache():
    on = cache_intent(PagedAttentionMode.ON)
    with pytest.raises(
        PagedAttentionRequiredError, match="the worker built an eager KV cache, not a paged one"
    ):
        select_scheduler(on, CacheKind.EAGER)
    with pytest.raises(PagedAttentionRequiredError, match="no KV cache"):
        select_scheduler(on, None)


def test_auto_falls_back_to_default_scheduler():
    assert select_scheduler(cache_intent(PagedAttentionMode.AUTO), CacheKind.EAGER) is CacheKind.EAGER
    assert select_scheduler(cache_intent(PagedAttentionMode.OFF), CacheKind.EAGER) is CacheKind.EAGER


def test_paged_scheduler_selected_when_cache_metadata_exists():
    for mode in (PagedAttentionMode.AUTO, PagedAttentionMode.ON):
        assert select_scheduler(cache_intent(mode), CacheKind.PAGED) is CacheKind.PAGED


REAL_SUPPORT = KernelSupport(
    head_sizes=frozenset({64, 128, 256}),
    block_sizes=frozenset({16}),
    dtypes=frozenset({"float16", "bfloat16", "float32"}),
    min_compute_capability=(8, 0),
    shared_memory_bytes=((("float32", 256), 139_648), (("bfloat16", 256), 70_016)),
)


def gpu(name: str, cc: tuple[int, int], shared: int) -> DeviceInfo:
    return DeviceInfo(
        kind="cuda",
        name=name,
        compute_capability=cc,
        triton_version="3.9.0",
        triton_support=REAL_SUPPORT,
        max_shared_memory_per_block=shared,
    )


def test_a_gpu_whose_shared_memory_cannot_hold_the_tiles_falls_back_through_the_kernels_door():
    l4, fp32_256 = gpu("NVIDIA L4", (8, 9), 101_376), ModelTraits(head_size=256, dtype="float32")
    auto = state("auto")
    assert decide(l4, auto, fp32_256) is None
    [(component, reason)] = auto.fallbacks
    assert component == "kernels"
    assert reason.startswith(
        "the Triton paged kernels need 139648 bytes of shared memory per block for float32 KV with head size "
        "256, and NVIDIA L4 allows 101376"
    )
    with pytest.raises(PagedAttentionRequiredError, match="139648 bytes of shared memory"):
        decide(l4, state("on"), fp32_256)
    # bf16 KV needs half, and an A100 (163 KB opt-in) holds fp32 too.
    assert decide(l4, state("on"), ModelTraits(head_size=256, dtype="bfloat16")) is not None
    assert decide(gpu("NVIDIA A100", (8, 0), 166_912), state("on"), fp32_256) is not None


def test_the_support_table_covers_every_supported_shape_and_grows_with_dtype_and_head():
    from kvpact.kernels import support
    from kvpact.worker.startup.device import kernel_support

    table = dict(kernel_support((8, 9)).shared_memory_bytes)  # L4
    assert set(table) == {(d, h) for d in support.TRITON_DTYPES for h in support.TRITON_HEAD_SIZES}
    assert table[("float32", 256)] == 139_648 and table[("float32", 128)] == 74_112  # measured, sm_86
    assert 69_760 <= table[("bfloat16", 256)] <= 99 * 1024  # measured 69,760: bf16 x 256 fits an L4
    assert all(table[(d, 128)] <= 99 * 1024 < table[("float32", 256)] for d in support.TRITON_DTYPES)
    hopper = dict(kernel_support((9, 0)).shared_memory_bytes)
    assert hopper[("bfloat16", 128)] >= 49_280 and hopper[("float32", 256)] == 139_648  # 3-stage 16-bit
