"""The pre-load checks: one small function per condition. Each reads the plan being made (`Planning`) and
returns a Finding (why its feature cannot be realized here, shared/reasons.py) or None; `run_checks`
runs them in `CHECKS` order and sends each finding through its feature's door (recorded under auto,
raised under on).

NOTE: a check runs only while its feature is in force, and later features read earlier outcomes
(prefix caching reads whether the paged cache survived; it never turns it on). The sizing check also
refines the plan: the paged pool's size and --max-model-len auto's fit. Tensor parallel: after each
feature's own checks, its every_rank check reads the other ranks' own verdicts, so every feature is
realized alike on every rank (under auto they fall back together; under on the worker fails).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kvpact.kernels import cpu_paged
from kvpact.shared import reasons
from kvpact.shared.capability import ModelTraits, choose_backend
from kvpact.shared.features import FeatureIntents, FeatureMode, Ledger
from kvpact.shared.intent import PagedAttentionConfig, PagedBackend
from kvpact.shared.reasons import (
    CPU_KERNELS,
    CUDA_GRAPHS,
    PAGED_ATTN,
    PREFIX_CACHING,
    QUANT_KERNELS,
    Finding,
)
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.kv import sizing
from kvpact.worker.loader.header import ModelHeader
from kvpact.worker.model import ModelConfig
from kvpact.worker.parallel.rank_verdict import RankVerdict
from kvpact.worker.startup.device import DeviceProbe
from kvpact.worker.startup.kernel_check import triton_self_test


@dataclass(slots=True)
class Planning:
    """The plan being made: what the checks read, and what the sizing check refines."""

    spec: WorkerSpec
    probe: DeviceProbe
    config: ModelConfig
    dtype: torch.dtype
    cache_dtype: torch.dtype
    defaults: sizing.DeviceDefaults
    ledger: Ledger  # every feature's door and findings, paged-attn's included
    max_model_len: int
    fit_to_cache: bool  # --max-model-len auto: still to be fitted to the cache
    max_model_len_source: str
    max_num_batched_tokens: int
    weight_bytes: int
    bytes_per_token: int
    projection_storage: tuple[str, ...]  # the model header's (GGUF tensor types, or "safetensors")
    backend: PagedBackend | None = None  # set by the device check
    paged_size: sizing.PagedSize | None = None  # set by the KV budget check
    rank_verdicts: tuple[RankVerdict, ...] = field(default_factory=tuple)  # ranks 1..N-1's own plans
    rank_blame: dict[str, int] = field(default_factory=dict)  # feature -> the rank that could not realize it

    @property
    def paged(self) -> bool:
        return self.ledger.in_force(PAGED_ATTN)

    @property
    def paged_config(self) -> PagedAttentionConfig | None:
        """The paged cache's settings while paged-attn is in force (derived: the door is the ledger's)."""
        return self.spec.cache.paged if self.paged else None

    def in_force(self, feature: str) -> bool:
        return self.ledger.in_force(feature)

    def fall_back(self, feature: str, finding: Finding) -> None:
        self.ledger.fall_back(feature, finding)
        if feature == PAGED_ATTN:
            self.backend, self.paged_size = None, None


Check = Callable[[Planning], Finding | None]


def paged_device(p: Planning) -> Finding | None:
    """Device, build and model traits: the backend, or why PagedAttention cannot run (capability.py)."""
    traits = ModelTraits(head_size=p.config.head_dim, dtype=str(p.cache_dtype).removeprefix("torch."))
    assert p.paged_config is not None
    p.backend, finding = choose_backend(p.probe.info, p.paged_config, p.spec.cache.required, traits)
    return finding


def paged_sliding_window(p: Planning) -> Finding | None:
    window = p.config.sliding_window
    if window is not None and window < p.max_model_len:
        return reasons.SLIDING_WINDOW.found(window=window, max_model_len=p.max_model_len)
    return None


def paged_staged_map(p: Planning) -> Finding | None:
    """A --device-map of two or more entries runs as stages (worker/model/stages.py); the paged cache does
    not span stages. (A map mixing CPU and an accelerator fell back in paged_device already.)"""
    placements = p.spec.device_map
    if len(placements) < 2:
        return None
    text = ",".join(f"{e.device}={e.num_layers}" for e in placements)
    return reasons.STAGED_DEVICE_MAP.found(device_map=text, num_stages=len(placements))


def paged_kv_budget(p: Planning) -> Finding | None:
    """Size the pool (and fit --max-model-len auto to it); a pool short of one sequence is the finding."""
    assert p.paged_config is not None
    max_num_seqs = p.spec.max_num_seqs or p.defaults.paged_max_num_seqs
    activations = sizing.activation_headroom_bytes(
        device_kind=p.probe.info.kind,
        hidden_size=p.config.hidden_size,
        intermediate_size=p.config.intermediate_size,
        vocab_size=p.config.vocab_size,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        dtype_bytes=torch.empty((), dtype=p.dtype).element_size(),
    )
    p.paged_size = sizing.size_paged_cache(
        p.paged_config,
        device_kind=p.probe.info.kind,
        memory_total_bytes=p.probe.memory_total_bytes,
        memory_free_bytes=p.probe.memory_free_bytes,
        weight_bytes=p.weight_bytes,
        activation_bytes=activations,
        bytes_per_token=p.bytes_per_token,
        max_model_len=p.max_model_len,
        max_num_seqs=max_num_seqs,
    )
    if p.fit_to_cache and p.paged_size.capacity_tokens:
        p.max_model_len, p.max_model_len_source = sizing.fit_paged(p.paged_size, p.max_model_len)
    message = sizing.shortfall(p.paged_size, p.max_model_len)
    return Finding(reasons.KV_BUDGET, message) if message else None


def paged_kernel_self_test(p: Planning) -> Finding | None:
    if p.backend is not PagedBackend.TRITON:
        return None
    assert p.paged_config is not None
    return triton_self_test(
        p.probe.device,
        p.cache_dtype,
        num_heads=p.config.num_heads,
        num_kv_heads=p.config.num_kv_heads,
        head_dim=p.config.head_dim,
        block_size=p.paged_config.block_size,
    )


def every_rank(feature: str) -> Check:
    """Tensor parallel: `feature` is realized alike on every rank. A rank whose own plan (on its own device)
    does not realize it is the finding, naming the rank (and `rank_blame` remembers which, for the error)."""

    def check(p: Planning) -> Finding | None:
        for v in p.rank_verdicts:
            why = v.unmet(feature)
            if why is not None:
                p.rank_blame[feature] = v.rank
                return reasons.TENSOR_PARALLEL_RANK.found(rank=v.rank, device=v.device, why=why)
        return None

    check.__name__ = f"every_rank({feature})"
    return check


def paged_every_rank(p: Planning) -> Finding | None:
    """The cache is one kind on every rank (every_rank), and the paged pools share one block table, so each
    holds the smallest rank's number of blocks."""
    if finding := every_rank(PAGED_ATTN)(p):
        return finding
    for v in p.rank_verdicts:
        if p.paged_size is not None and v.problem is None and v.num_blocks < p.paged_size.num_blocks:
            p.paged_size = replace(p.paged_size, num_blocks=v.num_blocks)
    return None


def prefix_needs_paged(p: Planning) -> Finding | None:
    if p.paged:
        return None
    found = p.ledger.findings.get(PAGED_ATTN)
    why = found.message if found else "--paged-attn off"
    return reasons.PREFIX_NEEDS_PAGED.found(why=why)


def cpu_kernels_device(p: Planning) -> Finding | None:
    if p.probe.device.type != "cpu":
        return reasons.CPU_KERNELS_DEVICE.found(device=p.probe.device.type)
    return None


def cpu_kernels_dtype(p: Planning) -> Finding | None:
    if p.cache_dtype not in cpu_paged.CACHE_DTYPES:
        return reasons.CPU_KERNELS_DTYPE.found(dtype=str(p.cache_dtype).removeprefix("torch."))
    return None


def cpu_kernels_window(p: Planning) -> Finding | None:
    if not p.paged and p.config.sliding_window is not None:  # the eager cache windows; the C decode cannot
        return reasons.CPU_KERNELS_WINDOW.found(window=p.config.sliding_window)
    return None


def cpu_kernels_build(p: Planning) -> Finding | None:
    """Compile (once per machine, about a second; cached) and load the C kernels, before any weight."""
    loaded = cpu_paged.load(p.cache_dtype, p.probe.device)
    return reasons.CPU_KERNELS_BUILD.found(error=loaded) if isinstance(loaded, str) else None


def quant_needs_cpu_kernels(p: Planning) -> Finding | None:
    if p.in_force(CPU_KERNELS):
        return None
    found = p.ledger.findings.get(CPU_KERNELS)
    return reasons.QUANT_NEEDS_CPU_KERNELS.found(why=found.message if found else "--cpu-kernels off")


def quant_dtype(p: Planning) -> Finding | None:
    if p.dtype is not torch.float32:
        return reasons.QUANT_DTYPE.found(dtype=str(p.dtype).removeprefix("torch."))
    return None


def quant_one_call(p: Planning) -> Finding | None:
    if p.spec.tensor_parallel_size > 1:
        return reasons.QUANT_ONE_CALL.found(how=f"--tensor-parallel-size {p.spec.tensor_parallel_size}")
    if len(p.spec.device_map) > 1:
        return reasons.QUANT_ONE_CALL.found(how=f"a --device-map of {len(p.spec.device_map)} stages")
    return None


def quant_panels(p: Planning) -> Finding | None:
    """cpu-kernels' build check loaded the kernels; a build without panels has no quantized ones."""
    ops = cpu_paged.load(torch.float32, p.probe.device)
    if isinstance(ops, str) or not ops.quant_max_rows:
        return reasons.QUANT_NO_PANELS.found()
    return None


def quant_stored(p: Planning) -> Finding | None:
    """From the file's header: the values are checked after loading (engine_setup, QUANT_EXACT)."""
    if p.projection_storage != ("Q4_1",):
        return reasons.QUANT_STORED.found(storage=" and ".join(p.projection_storage) or "no known tensors")
    return None


def quant_copy_bytes(p: Planning, header: ModelHeader) -> int:
    """What quant-kernels' copies add beside the float32 weights (the projections' Q4_1 panels, 6 bits a
    weight, and the head's Q8_0 ones, 9: worker/engine/fused_decode.py, engine_setup.use_q8_head) where
    it is not off and its checks that read no other feature's verdict pass; else 0. The KV budget is
    sized before quant-kernels' verdict (it follows cpu-kernels', which reads paged-attn's), so the
    weights' memory counts the copies wherever they may be made: one that a later check, or the values'
    own check after loading, turns down leaves its bytes unused, never more memory used than planned."""
    if FeatureMode.OFF in (p.spec.features.mode(QUANT_KERNELS), p.spec.features.mode(CPU_KERNELS)):
        return 0
    if quant_dtype(p) or quant_one_call(p) or quant_panels(p) or quant_stored(p):
        return 0
    ops = cpu_paged.required(torch.float32, p.probe.device)
    block = ops.panel_width * cpu_paged.QUANT_BLOCK  # the weights of one panel's block
    copies = header.projection_numel // block * ops.q4_block_bytes
    if header.head_storage == "Q8_0":
        copies += header.head_numel // block * ops.q8_block_bytes
    return copies


def cuda_graphs_device(p: Planning) -> Finding | None:
    if p.probe.info.kind != "cuda":
        return reasons.NO_CUDA.found(device=p.probe.info.kind)
    return None


def cuda_graphs_triton(p: Planning) -> Finding | None:
    """The capture itself needs the weights: it runs after loading (engine_setup._capture_graphs)."""
    if not p.paged:
        found = p.ledger.findings.get(PAGED_ATTN)
        return reasons.GRAPHS_NEED_TRITON.found(
            what=f"an eager KV cache ({found.message if found else '--paged-attn off'})"
        )
    if p.backend is not PagedBackend.TRITON:
        return reasons.GRAPHS_NEED_TRITON.found(what="the torch paged backend (--pa-backend torch)")
    return None


def agreed_on_every_rank(checks: tuple[tuple[str, Check], ...]) -> tuple[tuple[str, Check], ...]:
    """`checks` with each feature's every_rank check after its last own check (paged-attn has its own,
    paged_every_rank), and after all of them for a feature without checks: every feature of the registry
    is realized alike on every rank, a feature added later too."""
    out: list[tuple[str, Check]] = []
    for i, (feature, check) in enumerate(checks):
        out.append((feature, check))
        if feature != PAGED_ATTN and all(f != feature for f, _ in checks[i + 1 :]):
            out.append((feature, every_rank(feature)))
    out += [(f, every_rank(f)) for f in FeatureIntents.names() if all(f != g for g, _ in checks)]
    return tuple(out)


CHECKS: tuple[tuple[str, Check], ...] = agreed_on_every_rank((
    (PAGED_ATTN, paged_device),
    (PAGED_ATTN, paged_sliding_window),
    (PAGED_ATTN, paged_staged_map),
    (PAGED_ATTN, paged_kv_budget),
    (PAGED_ATTN, paged_kernel_self_test),
    (PAGED_ATTN, paged_every_rank),
    (PREFIX_CACHING, prefix_needs_paged),
    (CPU_KERNELS, cpu_kernels_device),
    (CPU_KERNELS, cpu_kernels_dtype),
    (CPU_KERNELS, cpu_kernels_window),
    (CPU_KERNELS, cpu_kernels_build),
    (QUANT_KERNELS, quant_needs_cpu_kernels),
    (QUANT_KERNELS, quant_dtype),
    (QUANT_KERNELS, quant_one_call),
    (QUANT_KERNELS, quant_panels),
    (QUANT_KERNELS, quant_stored),
    (CUDA_GRAPHS, cuda_graphs_device),
    (CUDA_GRAPHS, cuda_graphs_triton),
))  # fmt: skip


def run_checks(p: Planning, checks: tuple[tuple[str, Check], ...] = CHECKS) -> None:
    """Each check whose feature is still in force, in order; each finding through that feature's door."""
    for feature, check in checks:
        if p.in_force(feature) and (finding := check(p)):
            p.fall_back(feature, finding)
