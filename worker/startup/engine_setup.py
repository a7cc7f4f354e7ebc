"""Start a worker's engine, honoring each feature's intent (--paged-attn, --prefix-caching, --cpu-kernels,
--cuda-graphs), in two halves: `plan_startup` runs every check knowable before loading (startup/checks.py;
fast, no weights read), `build_engine` loads and builds what was planned.

NOTE: every "cannot" goes through its feature's door (recorded under `auto`, raised under `on`); the
build only builds what the plan decided (a cache told to run the C kernels raises if it cannot), and the
scheduler is chosen once more from what was built (`select_scheduler`), so `on` never ends without the
feature. The checks in order, and which component each names: docs/worker-startup.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from kvpact.kernels import cpu_paged
from kvpact.shared import reasons
from kvpact.shared.describe import realized_table
from kvpact.shared.errors import ConfigError, FeatureRequiredError, PagedAttentionRequiredError
from kvpact.shared.features import FeatureIntents, FeatureState, Ledger, describe_features, updated_states
from kvpact.shared.fingerprint import Fingerprint
from kvpact.shared.intent import CacheDtype, PagedBackend
from kvpact.shared.realized import BuiltFeatures, RealizedCache, realizes
from kvpact.shared.reasons import CPU_KERNELS, CUDA_GRAPHS, PAGED_ATTN, PREFIX_CACHING, QUANT_KERNELS, Finding
from kvpact.shared.scheduler_choice import CacheKind, select_scheduler
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine.cpu_share import CpuShare
from kvpact.worker.engine.decode_graphs import PARITY_TOLERANCE, DecodeGraphs
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.fused_decode import fused_decode
from kvpact.worker.engine.model_runner import ModelRunner
from kvpact.worker.kv import sizing
from kvpact.worker.kv.eager import EagerCache
from kvpact.worker.kv.paged import PagedCache
from kvpact.worker.kv.staged import StagedCache
from kvpact.worker.loader import load_model, resolve_dtype
from kvpact.worker.loader.header import ModelHeader, read_model_header
from kvpact.worker.model import LlamaForCausalLM, ModelConfig
from kvpact.worker.model.layers import Linear
from kvpact.worker.model.stages import plan_stages
from kvpact.worker.model.tensor_parallel import shard_model, tp_problem
from kvpact.worker.parallel.rank_verdict import RankBuild, RankVerdict
from kvpact.worker.parallel.ranks import RankGroup
from kvpact.worker.scheduler.base import Scheduler
from kvpact.worker.scheduler.block_manager import BlockManager
from kvpact.worker.scheduler.eager import EagerScheduler
from kvpact.worker.scheduler.paged import PagedScheduler
from kvpact.worker.startup.checks import Planning, quant_copy_bytes, run_checks
from kvpact.worker.startup.device import DeviceProbe, missing_map_device, probe_device
from kvpact.worker.startup.kernel_warmup import warm_up_paged_kernels

_CACHE_DTYPES = {
    CacheDtype.FLOAT32: torch.float32,
    CacheDtype.FLOAT16: torch.float16,
    CacheDtype.BFLOAT16: torch.bfloat16,
}


@dataclass(slots=True)
class WorkerPlan(BuiltFeatures):
    """Everything decided before a weight is read. `features` is what each feature will realize (what was
    built, before the build confirms it); the cache's kind and paged-attn's fallback derive from it."""

    spec: WorkerSpec
    probe: DeviceProbe
    model_path: Path
    model_config: ModelConfig
    backend: PagedBackend | None  # PAGED only
    features: tuple[FeatureState, ...]
    dtype: torch.dtype
    cache_dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prompt_tokens_beside_decodes: int | None  # the device default's, unless the flag set the budget
    weight_bytes: int
    bytes_per_token: int
    paged_size: sizing.PagedSize | None
    verdict_seconds: float
    fingerprint: Fingerprint  # what must agree with the workers serving its model name (router --uniform)
    notes: list[str] = field(default_factory=list)
    max_model_len_source: str = ""  # how max_model_len was chosen (a flag, a default, or auto's fit)
    ranks: RankGroup | None = None  # tensor parallel, planned with its ranks: they wait for the build
    rank_devices: tuple[str, ...] = ()  # each rank's device (rank order)

    def log_fields(self) -> dict[str, Any]:
        return {
            "device": str(self.probe.device),
            "mode": self.spec.cache.mode.value,
            "cache": self.kind.value,
            "backend": self.backend.value if self.backend else None,
            "max_model_len": self.max_model_len,
            "max_model_len_source": self.max_model_len_source,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "prompt_tokens_beside_decodes": self.prompt_tokens_beside_decodes,
            "weight_bytes": self.weight_bytes,
            "features": describe_features(self.features),
            "fingerprint": self.fingerprint.describe(),
            "fallbacks": [f"{f.component}: {f.reason}" for f in self.fallbacks],
        }


def plan_startup(
    spec: WorkerSpec,
    *,
    probe: DeviceProbe | None = None,
    log: Any = None,
    with_ranks: bool = False,
    visible_gpus: str | None = None,
    header: ModelHeader | None = None,
    rank_verdicts: tuple[RankVerdict, ...] | None = None,
) -> WorkerPlan:
    """`probe`: the device as already probed (the worker process probes first, so a failed plan can still
    report the device's capabilities); None probes `spec.device` here. The feature checks are
    startup/checks.py's, run in order; every fallback is logged once, here, with its reason.
    `with_ranks` (--tensor-parallel-size above 1): spawn the other ranks, have each plan on its own device,
    and decide from every verdict (the plan's `ranks` then lead them; a failed plan stops them);
    `visible_gpus`: the worker's CUDA_VISIBLE_DEVICES as it started (ranks.claim_gpus), split per rank.
    `header`: the model's header as already read (read_model_header; None reads it here, once);
    `rank_verdicts`: ranks 1..N-1's own verdicts as already made (plan_only plans them in this process)."""
    log = log or structlog.get_logger("worker.engine_setup")
    started = time.monotonic()
    if probe is None:
        probe = probe_device(spec.device, spec.device_map)
    header = header or read_model_header(spec.model or None)
    p = _begin(spec, probe, header)
    if rank_verdicts is not None:
        _check_tensor_parallel(spec, p.config, probe)
        p.rank_verdicts = rank_verdicts
    ranks = None
    if with_ranks and spec.tensor_parallel_size > 1:
        _check_tensor_parallel(spec, p.config, probe)
        ranks = start_ranks(spec, visible_gpus)
    try:
        plan = _plan(spec, probe, p, ranks, started, header)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    log_fallbacks(plan.features, log)
    log.info("pre-load verdict", seconds=round(plan.verdict_seconds, 3), **plan.log_fields())
    return plan


def _plan(
    spec: WorkerSpec,
    probe: DeviceProbe,
    p: Planning,
    ranks: RankGroup | None,
    started: float,
    header: ModelHeader,
) -> WorkerPlan:
    devices = rank_devices(probe.device, spec.tensor_parallel_size)
    if ranks is not None:
        p.rank_verdicts = tuple(ranks.verdicts(spec, devices, header))
    try:
        run_checks(p)
    except FeatureRequiredError as e:  # with other ranks: named, rank 0's own refusal too
        if not p.rank_verdicts:
            raise
        if e.feature in p.rank_blame:  # another rank's (checks.every_rank): its message names it
            e.rank = p.rank_blame[e.feature]
            raise
        raise _as_rank(e, 0, devices[0]) from e
    for v in p.rank_verdicts:  # another feature's refusal or a bad flag on a rank (paged-attn's: a check's)
        if v.problem is not None:
            raise v.problem.error(v.rank, v.device)
    _check_device_map(spec, p.config)
    _check_tensor_parallel(spec, p.config, probe)
    if p.paged:
        max_num_seqs = spec.max_num_seqs or p.defaults.paged_max_num_seqs
    else:
        max_num_seqs = _size_eager(p)
    features = p.ledger.states()
    block_size = p.paged_config.block_size if p.paged_config is not None else 0
    fingerprint = header.digests.fingerprint(
        dtype=str(p.dtype).removeprefix("torch."),
        cache_dtype=str(p.cache_dtype).removeprefix("torch."),
        max_model_len=p.max_model_len,
        block_size=block_size,
        tensor_parallel_size=spec.tensor_parallel_size,
    )
    plan = WorkerPlan(
        spec=spec,
        probe=probe,
        model_path=header.path,
        model_config=p.config,
        backend=p.backend if p.paged else None,
        features=features,
        dtype=p.dtype,
        cache_dtype=p.cache_dtype,
        max_model_len=p.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        prompt_tokens_beside_decodes=(
            p.spec.prompt_tokens_beside_decodes
            or (None if p.spec.max_num_batched_tokens else p.defaults.prompt_tokens_beside_decodes)
        ),
        weight_bytes=p.weight_bytes,
        bytes_per_token=p.bytes_per_token,
        paged_size=p.paged_size if p.paged else None,
        verdict_seconds=time.monotonic() - started,
        fingerprint=fingerprint,
        max_model_len_source=p.max_model_len_source,
        ranks=ranks,
        rank_devices=tuple(devices),
    )
    return plan


def rank_devices(device: torch.device, world: int) -> list[str]:
    """Each rank's device: the CPU for every rank, or `cuda:K+r` for rank r from `--device cuda:K`."""
    if device.type != "cuda" or world == 1:
        return [str(device)] * world
    first = device.index or 0
    return [f"cuda:{first + r}" for r in range(world)]


def _as_rank(e: FeatureRequiredError, rank: int, device: str) -> FeatureRequiredError:
    finding = reasons.TENSOR_PARALLEL_RANK.found(rank=rank, device=device, why=e.reason)
    error = FeatureRequiredError(finding.message, e.component, feature=e.feature, code=e.code)
    if e.feature == reasons.PAGED_ATTN:
        error = PagedAttentionRequiredError(finding.message, e.component, e.code)
    error.rank = rank
    return error


def log_fallbacks(features: tuple[FeatureState, ...], log: Any) -> None:
    """One line per feature that fell back (asked auto, realized off), with its reason."""
    for f in features:
        if f.fell_back:
            log.warning(
                "feature fallback",
                feature=f.name,
                requested=f.requested.value,
                reason=f.code,
                component=f.component,
                message=f.message,
            )


def _begin(spec: WorkerSpec, probe: DeviceProbe, header: ModelHeader | None = None) -> Planning:
    """What the checks start from: the model's config (no weights), dtypes, sizing inputs, every intent."""
    header = header or read_model_header(spec.model or None)
    config = header.config
    dtype = resolve_dtype(probe.device, spec.dtype, probe.info.compute_capability)
    cache_dtype = _cache_dtype(spec, dtype)
    defaults = sizing.device_defaults(probe.info.kind)
    max_model_len, fit_to_cache, source = _max_model_len(spec, config, defaults)
    itemsize = torch.empty((), dtype=cache_dtype).element_size()
    modes = {PAGED_ATTN: spec.cache.mode} | {n: spec.features.mode(n) for n in FeatureIntents.names()}
    p = Planning(
        spec=spec,
        probe=probe,
        config=config,
        dtype=dtype,
        cache_dtype=cache_dtype,
        defaults=defaults,
        ledger=Ledger(modes),
        max_model_len=max_model_len,
        fit_to_cache=fit_to_cache,
        max_model_len_source=source,
        max_num_batched_tokens=spec.max_num_batched_tokens or defaults.max_num_batched_tokens,
        weight_bytes=header.weight_bytes(dtype),
        projection_storage=header.projection_storage,
        bytes_per_token=sizing.kv_bytes_per_token(
            config.num_layers, config.num_kv_heads, config.head_dim, itemsize
        ),
    )
    p.weight_bytes += quant_copy_bytes(p, header)
    return p


def _size_eager(p: Planning) -> int:
    """The eager cache's slots (and --max-model-len auto's fit to them); raises when they cannot fit."""
    max_num_seqs = p.spec.max_num_seqs or p.defaults.eager_max_num_seqs
    if p.fit_to_cache:
        fit, how = sizing.fit_eager(
            model_limit=p.config.max_position_embeddings,
            num_slots=max_num_seqs,
            bytes_per_token=p.bytes_per_token,
            weight_bytes=p.weight_bytes,
            memory_free_bytes=p.probe.memory_free_bytes,
        )
        if fit:  # 0: nothing fits; check_eager_fits says so with the numbers
            p.max_model_len, p.max_model_len_source = fit, how
    sizing.check_eager_fits(
        num_slots=max_num_seqs,
        max_model_len=p.max_model_len,
        bytes_per_token=p.bytes_per_token,
        weight_bytes=p.weight_bytes,
        memory_free_bytes=p.probe.memory_free_bytes,
        device_kind=p.probe.info.kind,
    )
    return max_num_seqs


def build_engine(
    plan: WorkerPlan | WorkerSpec, *, log: Any = None, cpu_share: CpuShare | None = None
) -> Engine:
    """`cpu_share` sizes torch's CPU threads, for loading here and then in the step thread; None leaves
    torch's default (tests, benchmarks in-process)."""
    log = log or structlog.get_logger("worker.engine_setup")
    if isinstance(plan, WorkerSpec):
        plan = plan_startup(plan, log=log, with_ranks=True)
    if plan.spec.tensor_parallel_size > 1 and plan.ranks is None:
        raise ValueError("a tensor-parallel plan is built with its ranks: plan_startup(..., with_ranks=True)")
    try:
        return _build(plan, log, cpu_share)
    except BaseException:
        if plan.ranks is not None:
            plan.ranks.close()
        raise


def _build(plan: WorkerPlan, log: Any, cpu_share: CpuShare | None) -> Engine:
    if cpu_share is not None:
        threads = cpu_share.apply()
        log.info("cpu threads", threads=threads, requested=cpu_share.requested, cpus=len(cpu_share.cpus))
    placements = [(p.device, p.num_layers) for p in plan.spec.device_map]
    stages = plan_stages(placements, plan.model_config.num_layers, plan.probe.device)
    ranks = plan.ranks
    if ranks is not None:  # every rank builds what this plan decided, from every rank's verdict
        ranks.build(rank_build(plan))
    loaded = load_model(plan.model_path, device=plan.probe.device, dtype=plan.dtype, stages=stages)
    if ranks is not None:  # rank 0's shard; `config` below then counts this rank's heads
        loaded.model = shard_model(loaded.model, 0, ranks.world, ranks.all_reduce)
    packed = use_cpu_kernels(loaded.model, plan.realizes(CPU_KERNELS))
    if packed:
        log.info("the C kernels run packed weights", what=packed)
    config = loaded.model.config
    cache: PagedCache | EagerCache | StagedCache
    if plan.kind is CacheKind.PAGED:
        assert plan.paged_size is not None and plan.backend is not None
        cache = PagedCache(
            config.num_layers,
            plan.paged_size.num_blocks,
            plan.paged_size.block_size,
            config.num_kv_heads,
            config.head_dim,
            plan.cache_dtype,
            stages[0].device,  # one stage (a staged map falls back to eager before this)
            plan.backend,
            max_model_len=plan.max_model_len,
            cpu_kernels=plan.realizes(CPU_KERNELS),
        )
        log.info("paged attention kernels", backend=cache.backend.value, kernels=cache.kernels)
        if cache.backend is PagedBackend.TRITON:
            warm = warm_up_paged_kernels(cache, num_heads=config.num_heads, dtype=plan.dtype)
            log.info(
                "paged kernels warmed up",
                seconds=round(warm.seconds, 2),
                compiled=warm.compiled,
                variants=list(warm.variants),
            )
    else:

        def eager(num_layers: int, device: torch.device) -> EagerCache:
            return EagerCache(
                num_layers,
                plan.max_num_seqs,
                plan.max_model_len,
                config.num_kv_heads,
                config.head_dim,
                plan.cache_dtype,
                device,
                sliding_window=config.sliding_window,
                cpu_kernels=plan.realizes(CPU_KERNELS),
            )

        # A map of two or more entries runs as stages, each layer's cache on its layer's device.
        cache = StagedCache(stages, eager) if len(stages) > 1 else eager(config.num_layers, stages[0].device)
        log.info("eager attention kernels", kernels=cache.kernels)
    scheduler_kind = select_scheduler(plan.spec.cache, cache.kind)  # the backstop: from what was built
    scheduler: Scheduler
    if scheduler_kind is CacheKind.PAGED:
        assert isinstance(cache, PagedCache)
        manager = BlockManager(cache.num_blocks, cache.block_size, plan.realizes(PREFIX_CACHING))
        scheduler = PagedScheduler(
            manager, plan.max_num_seqs, plan.max_num_batched_tokens, plan.prompt_tokens_beside_decodes
        )
    else:
        scheduler = EagerScheduler(
            plan.max_num_seqs, plan.max_num_batched_tokens, plan.prompt_tokens_beside_decodes
        )
    features, graphs = plan.features, None
    if plan.realizes(CUDA_GRAPHS):
        assert isinstance(cache, PagedCache)  # the plan's cuda_graphs_triton check
        features, graphs = _capture_graphs(plan, loaded.model, cache, log)
    quant = plan.realizes(QUANT_KERNELS)
    fused = fused_decode(loaded.model, cache, quant=quant)  # None under tensor parallel or a staged map
    if fused is not None:
        log.info(
            "small steps run every decoder layer in one C call",
            max_rows=cpu_paged.SMALL_BATCH_ROWS,
            q4_1_panels=fused.q4,
        )
    if quant and (fused is None or fused.q4_missing):  # the values, checked now they are loaded
        why = fused.q4_missing if fused is not None else "the decoder layers are not one C call"
        features = _fall_back_after_load(features, QUANT_KERNELS, reasons.QUANT_EXACT.found(why=why), log)
    elif quant:
        log.info("the LM head's Q8_0 panels", q8_0_head=use_q8_head(loaded.model))
    realized = realized_cache(plan, cache, features)
    log.info(
        "realized KV cache\n" + realized_table(realized),
        model=loaded.name,
        load_seconds=round(loaded.load_seconds, 2),
    )
    runner = ModelRunner(loaded.model, cache, stages[0].device)
    runner.graphs = graphs
    runner.fused = fused
    if ranks is not None:
        ranks.ready()
        runner.ranks = ranks
    return Engine(
        runner,
        scheduler,
        loaded.tokenizer,
        realized=realized,
        model_name=loaded.name,
        max_model_len=plan.max_model_len,
        vocab_size=config.vocab_size,
        log=log,
        cpu_share=cpu_share,
    )


def _capture_graphs(
    plan: WorkerPlan, model: LlamaForCausalLM, cache: PagedCache, log: Any
) -> tuple[tuple[FeatureState, ...], DecodeGraphs | None]:
    """CUDA graphs for decode, captured and checked against the eager step (they need the weights, so
    this runs after loading): the features as built, and the graphs, or None where the capture or its
    check failed (cuda-graphs' door: recorded under auto, raised under on)."""
    began = time.monotonic()
    graphs = DecodeGraphs(model, cache, plan.max_num_seqs, plan.max_model_len)
    device = str(cache.device)
    try:
        graphs.build()
        error = graphs.parity_error()
    except Exception as e:  # noqa: BLE001 - any capture error is cuda-graphs' finding, by its door
        finding = reasons.GRAPHS_CAPTURE.found(device=device, error=f"{type(e).__name__}: {e}")
    else:
        if error <= PARITY_TOLERANCE:
            log.info(
                "cuda graphs captured",
                sizes=list(graphs.sizes),
                seconds=round(time.monotonic() - began, 2),
                parity_error=error,
            )
            return plan.features, graphs
        finding = reasons.GRAPHS_PARITY.found(device=device, error=error, tolerance=PARITY_TOLERANCE)
    return _fall_back_after_load(plan.features, CUDA_GRAPHS, finding, log), None


def _fall_back_after_load(
    features: tuple[FeatureState, ...], feature: str, finding: Finding, log: Any
) -> tuple[FeatureState, ...]:
    """A check that needs the loaded weights (cuda-graphs' capture, quant-kernels' values) found
    `feature` cannot run: its door, as before loading (auto: recorded and logged; on: raises
    FeatureRequiredError, exit 78). Returns `features` with its new state."""
    mode = next(f.requested for f in features if f.name == feature)
    ledger = Ledger({feature: mode})
    ledger.fall_back(feature, finding)
    updated = updated_states(features, (ledger.state(feature),))
    log_fallbacks(tuple(f for f in updated if f.name == feature), log)
    return updated


def use_cpu_kernels(model: LlamaForCausalLM, cpu_kernels: bool) -> str:
    """Where --cpu-kernels realized and the weights are float32 or bfloat16, the model runs the C
    kernels (kernels/cpu_paged.py). Float32: every RMSNorm, and the projections and LM head of small
    batches (larger ones stay on torch's matmul). Where the build packs (AVX-512 or AVX2) and every
    decoder projection's output size is a multiple of its panel, the decoder layers' projections are
    packed instead and run the packed kernel at every batch size; so is the LM head where its vocabulary
    is such a multiple (a tied head packs the embedding's table, which its lookups then read packed).
    Bfloat16 (`--dtype bfloat16`): the same packing, in pairs, where the build packs; the rest of the
    model stays on torch's bf16 ops (quant-kernels' Q8_0 head: `use_q8_head`). Returns what was packed,
    for the startup log ("" for nothing: the kernels not realized, a build without panels, or output
    sizes that are not multiples of the panel)."""
    weight = model.model.embed_tokens.weight
    dtype = weight.dtype
    if not (cpu_kernels and dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"):
        return ""
    del weight  # packing replaces it: not held twice past its own copy
    ops = cpu_paged.required(torch.float32, torch.device("cpu"))
    if dtype is torch.float32:  # a bfloat16 model keeps its own norms (their variance in float32)
        model.use_kernels(ops.linear, ops.rms_norm)
    packed = []
    projections = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, Linear)]
    if projections and all(ops.packs(m.weight) for m in projections):
        for m in projections:
            m.use_packed(ops.pack(m.weight), ops.packed_linear)
        packed.append(f"{len(projections)} projections")
    head = model.lm_head or model.model.embed_tokens  # the tensor compute_logits reads
    if ops.packs(head.weight):
        if isinstance(head, Linear):
            head.use_packed(ops.pack(head.weight), ops.packed_linear)
        else:
            head.use_packed(ops.pack(head.weight))
        model.head_matmul = ops.packed_linear
        packed.append("the LM head")
    kind = "bfloat16 pairs" if dtype is torch.bfloat16 else "float32"
    return f"{' and '.join(packed)} in panels of {ops.panel_width} ({kind})" if packed else ""


def use_q8_head(model: LlamaForCausalLM) -> str:
    """quant-kernels realized (the decoder layers' Q4_1 panels: worker/engine/fused_decode.py): where the
    LM head is packed float32 panels holding exactly a GGUF's Q8_0 values (the bundled model's tied
    embedding), it is also packed as Q8_0 and read for a step's few sampled rows (`small_rows_linear`).
    Returns what the startup log says of it."""
    ops = cpu_paged.required(torch.float32, torch.device("cpu"))
    head = (model.lm_head or model.model.embed_tokens).weight
    if head.dtype is not torch.float32 or head.dim() != 3:
        return "no: the LM head is not float32 panels"
    q8 = ops.pack_q8(ops.unpack(head))
    if q8 is None:
        return "no: the LM head does not hold exactly Q8_0 values"
    model.head_matmul = ops.small_rows_linear(q8)
    return f"yes: for steps sampling up to {ops.quant_max_rows} rows"


def start_ranks(spec: WorkerSpec, visible_gpus: str | None = None) -> RankGroup:
    """Spawn and join ranks 1..N-1 (each then plans on its own device: RankGroup.verdicts)."""
    return RankGroup.start(spec.tensor_parallel_size, spec.threads, visible_gpus)


def rank_build(plan: WorkerPlan) -> RankBuild:
    size = plan.paged_size
    return RankBuild(
        model=str(plan.model_path),
        dtype=str(plan.dtype).removeprefix("torch."),
        cache_dtype=str(plan.cache_dtype).removeprefix("torch."),
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.max_num_seqs,
        paged=plan.kind is CacheKind.PAGED,
        num_blocks=size.num_blocks if size else 0,
        block_size=size.block_size if size else 0,
        backend=plan.backend.value if plan.backend else "",
        cpu_kernels=plan.realizes(CPU_KERNELS),
    )


def realized_cache(
    plan: WorkerPlan,
    cache: PagedCache | EagerCache | StagedCache,
    features: tuple[FeatureState, ...] = (),
) -> RealizedCache:
    """What was built: the cache's sizes beside every feature's state (paged-attn's is the cache's kind, so
    the two must agree: a paged cache exactly when paged-attn is realized)."""
    features = features or plan.features
    if isinstance(cache, PagedCache) != realizes(features, PAGED_ATTN):
        built = "a paged" if isinstance(cache, PagedCache) else "an eager"
        raise RuntimeError(f"built {built} KV cache yet the features say {describe_features(features)}")
    cache_dtype = next((k for k, v in _CACHE_DTYPES.items() if v == plan.cache_dtype), CacheDtype.AUTO)
    ranks = {
        "tensor_parallel_size": plan.spec.tensor_parallel_size,
        "rank_devices": plan.rank_devices or (str(plan.probe.device),),
    }
    if isinstance(cache, PagedCache):
        capacity = cache.num_blocks * cache.block_size
        return RealizedCache(
            max_model_len=plan.max_model_len,
            capacity_tokens=capacity,
            max_concurrency=capacity // plan.max_model_len,
            num_blocks=cache.num_blocks,
            memory_bytes=cache.memory_bytes,
            cache_dtype=cache_dtype,
            backend=cache.backend,
            block_size=cache.block_size,
            features=features,
            **ranks,  # type: ignore[arg-type]
        )
    return RealizedCache(
        max_model_len=plan.max_model_len,
        capacity_tokens=cache.num_slots * cache.max_model_len,
        max_concurrency=cache.num_slots,
        num_blocks=cache.num_slots,
        memory_bytes=cache.memory_bytes,
        cache_dtype=cache_dtype,
        features=features,
        **ranks,  # type: ignore[arg-type]
    )


def _cache_dtype(spec: WorkerSpec, dtype: torch.dtype) -> torch.dtype:
    paged = spec.cache.paged
    if paged is None or paged.cache_dtype is CacheDtype.AUTO:
        return dtype
    return _CACHE_DTYPES[paged.cache_dtype]


def _max_model_len(
    spec: WorkerSpec, config: ModelConfig, defaults: sizing.DeviceDefaults
) -> tuple[int, bool, str]:
    """(max_model_len, whether it is still to be fitted to the cache (auto), how it was chosen)."""
    limit = config.max_position_embeddings
    if spec.max_model_len:
        if spec.max_model_len > limit:
            raise ConfigError(
                f"--max-model-len {spec.max_model_len} is longer than the model's {limit} positions; "
                f"use at most {limit}"
            )
        return spec.max_model_len, False, f"--max-model-len {spec.max_model_len}"
    cap = defaults.max_model_len_cap
    if spec.max_model_len_auto or cap is None:  # explicit auto, or the CUDA default
        return limit, True, f"auto: the model's {limit} positions"
    return min(limit, cap), False, f"the default: min(the model's {limit} positions, {cap})"


def _check_tensor_parallel(spec: WorkerSpec, config: ModelConfig, probe: DeviceProbe) -> None:
    """The heads split over the ranks (the paged cache's verdict on every rank: checks.paged_every_rank)."""
    size = spec.tensor_parallel_size
    if size == 1:
        return
    if spec.device_map:
        raise ConfigError(
            f"--tensor-parallel-size {size} with --device-map is not supported; use one of them"
        )
    if probe.device.type != "cpu":
        raise ConfigError(f"--tensor-parallel-size {size} runs on CPU (gloo) in this build; use --device cpu")
    problem = tp_problem(config, size)
    if problem:
        raise ConfigError(problem)


def _check_device_map(spec: WorkerSpec, config: ModelConfig) -> None:
    """Counts that cover the model and devices this machine has (the paged cache's verdict on a staged map
    is checks.paged_staged_map's, before this, so `on` names its reason first)."""
    if not spec.device_map:
        return
    total = sum(p.num_layers for p in spec.device_map)
    if total != config.num_layers:
        raise ConfigError(
            f"--device-map places {total} layers but the model has {config.num_layers}; "
            f"make the counts add up to {config.num_layers}"
        )
    missing = missing_map_device(spec.device_map)
    if missing:
        raise ConfigError(missing)
