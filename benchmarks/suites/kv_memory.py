"""KV memory: how much of the allocated KV cache holds real tokens, how many sequences a fixed KV budget
serves at once (paged vs eager), and what the prefix cache saves on a shared-prefix workload.

    python -m benchmarks.run --suites kv_memory [--quick]

Every engine is built in-process through worker.engine_setup (what `worker` runs), on ctx.device, with the
backend `--paged-attn on` picks there (torch on CPU). benchmarks/kv_steps.py records the cache after
every step.

1. Fixed budget. B = the memory of EAGER_SLOTS eager slots at max_model_len (2048; 256 in --quick):
   for SmolLM2-135M in fp32 (46,080 bytes of K/V per token) 2 x 2048 tokens = 180 MiB. (The issue's
   example, 64 MiB, holds 1,456 tokens of this model: not one 2048-token sequence, so neither cache
   could start with it.) paged: `--paged-attn on --pa-memory-bytes B --max-num-seqs 256` (the pool,
   not the sequence cap, is the limit); eager: `--paged-attn off --max-num-seqs EAGER_SLOTS`. Both are
   offered the same mixed requests at once, enough that their prompts alone are 1.5x what the pool
   holds, and run for a bounded number of steps (the window): the pool fills, sequences grow,
   the paged scheduler preempts and readmits. Concurrency: the peak number of running sequences,
   and the sustained one (mean over the window's second half, after the pool has filled; the
   target uses this one). The paged cache runs twice: the default block size (16, the target's
   figure) and `--pa-block-size 8` (less of each sequence's last block left empty; its step time
   shows what that costs; not in --quick).
   Real tokens at peak: paged, at the step with the most blocks in use (ties: the lowest fraction),
   tokens held / (blocks in use x block size); eager, at the step holding the most tokens, tokens
   held / (slots x max_model_len).
2. Prefix cache. The shared_prefix workload (one 768-token system prompt + a 32-128 token question;
   4 requests. --quick: a 128-token system prompt, 2 requests, outputs cut to 16 tokens) on two
   paged engines that differ only in `--prefix-caching off`, default budget. One request with the
   system prompt runs first on each (the prompt a server has already seen), then the requests
   arrive at once. Hit rate = cached prompt tokens / prompt tokens (from each request's usage);
   throughput = (prompt + output tokens) / wall time of the timed phase.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks import workloads
from benchmarks.framework import BenchContext, SuiteResult, Target
from benchmarks.kv_memory_report import (
    PrefixRun,
    WindowRun,
    budget_table,
    figure,
    mib,
    prefix_data,
    prefix_table,
    window_data,
)
from benchmarks.kv_steps import StepLog
from benchmarks.kvpact_systems import greedy_request
from kvpact.shared.features import FeatureIntents, FeatureMode
from kvpact.shared.intent import PagedAttentionConfig, PagedAttentionMode, cache_intent
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine.request import GenerationOutput, GenerationRequest, GenerationResult
from kvpact.worker.startup.engine_setup import build_engine, plan_startup

NAME = "kv_memory"
EAGER_SLOTS = 2  # the budget is the memory of this many eager slots at max_model_len
PAGED_MAX_NUM_SEQS = 256
SMALL_BLOCK = 8
OVERSUBSCRIBE = 1.5  # offered prompt tokens / pool capacity in the fixed-budget runs
REAL_TOKENS_GOAL = 0.96
CONCURRENCY_GOAL = 4.0


@dataclass(frozen=True, slots=True)
class Scale:
    max_model_len: int
    window_steps: int
    window_cap_s: float
    prefix_requests: int
    prefix_tokens: int
    prefix_max_tokens: int | None  # None: the workload's own output lengths
    run_timeout_s: float
    small_block: bool  # also run the paged cache with --pa-block-size SMALL_BLOCK


FULL = Scale(
    2048,
    window_steps=64,
    window_cap_s=90.0,
    prefix_requests=4,
    prefix_tokens=768,
    prefix_max_tokens=None,
    run_timeout_s=300.0,
    small_block=True,
)
QUICK = Scale(
    256,
    window_steps=12,
    window_cap_s=8.0,
    prefix_requests=2,
    prefix_tokens=128,
    prefix_max_tokens=16,
    run_timeout_s=60.0,
    small_block=False,
)


def run(ctx: BenchContext) -> SuiteResult:
    scale = QUICK if ctx.quick else FULL
    probe = plan_startup(
        worker_spec(ctx.model, ctx.device, PagedAttentionMode.OFF, max_model_len=0, max_num_seqs=1)
    )
    max_model_len = min(scale.max_model_len, probe.model_config.max_position_embeddings)
    vocab = probe.model_config.vocab_size
    bytes_per_token = probe.bytes_per_token
    budget = EAGER_SLOTS * max_model_len * bytes_per_token
    capacity = budget // bytes_per_token
    pool = workloads.fit(workloads.mixed(96, ctx.seed, vocab), max_model_len)
    offered, prompt_tokens = 0, 0
    while offered < len(pool) and prompt_tokens < OVERSUBSCRIBE * capacity:
        prompt_tokens += len(pool[offered].prompt)
        offered += 1
    items = pool[:offered]

    windows = []
    paged_runs = [("paged", None)] + (
        [(f"paged, block {SMALL_BLOCK}", SMALL_BLOCK)] if scale.small_block else []
    )
    for label, block_size in paged_runs:
        spec = worker_spec(
            ctx.model,
            ctx.device,
            PagedAttentionMode.ON,
            max_model_len=max_model_len,
            max_num_seqs=PAGED_MAX_NUM_SEQS,
            memory_bytes=budget,
            block_size=block_size,
        )
        flags = f"--paged-attn on --pa-memory-bytes {budget} --max-num-seqs {PAGED_MAX_NUM_SEQS}"
        flags += f" --pa-block-size {block_size}" if block_size else ""
        windows.append(_window(label, spec, flags, items, budget, max_model_len, scale))
    spec = worker_spec(
        ctx.model, ctx.device, PagedAttentionMode.OFF, max_model_len=max_model_len, max_num_seqs=EAGER_SLOTS
    )
    flags = f"--paged-attn off --max-num-seqs {EAGER_SLOTS}"
    windows.append(_window("eager", spec, flags, items, budget, max_model_len, scale))
    paged, eager = windows[0], windows[-1]
    small = f"--pa-block-size {SMALL_BLOCK}: {windows[1].peak.fraction:.1%}; " if scale.small_block else ""

    shared = workloads.fit(
        workloads.shared_prefix(
            scale.prefix_requests + 1, ctx.seed, vocab, prefix_tokens=scale.prefix_tokens
        ),
        max_model_len,
    )
    if scale.prefix_max_tokens is not None:
        shared = [replace(i, max_tokens=min(i.max_tokens, scale.prefix_max_tokens)) for i in shared]
    prefix_runs = [_prefix_run(ctx, on, shared, max_model_len, scale) for on in (True, False)]

    command = f"python -m benchmarks.run --suites {NAME}" + (" --quick" if ctx.quick else "")
    fraction = paged.peak.fraction
    ratio = paged.sustained_running / eager.sustained_running
    targets = [
        Target(
            "KV memory holding real tokens at peak (paged)",
            f">= {REAL_TOKENS_GOAL:.0%}",
            f"{fraction:.1%}",
            fraction >= REAL_TOKENS_GOAL,
            f"block size 16, the default; {small}eager: {eager.peak.fraction:.1%}{_cut(windows)}",
        ),
        Target(
            f"concurrency at a fixed KV budget ({mib(budget)}, max_model_len {max_model_len})",
            f">= {CONCURRENCY_GOAL:g}x eager",
            f"{ratio:.1f}x ({paged.sustained_running:.1f} vs {eager.sustained_running:.1f} sequences)",
            ratio >= CONCURRENCY_GOAL,
            f"sustained: mean over the window's second half; peak {paged.peak_running} vs "
            f"{eager.peak_running}{_cut(windows)}",
        ),
    ]
    return SuiteResult(
        suite=NAME,
        tables=[
            budget_table(
                windows,
                eager_slots=EAGER_SLOTS,
                max_model_len=max_model_len,
                bytes_per_token=bytes_per_token,
                offered=items,
                command=command,
            ),
            prefix_table(prefix_runs, shared[1:], command),
        ],
        targets=targets,
        data={
            "budget_bytes": budget,
            "max_model_len": max_model_len,
            "bytes_per_token": bytes_per_token,
            "windows": {r.label: window_data(r) for r in windows},
            "prefix": [prefix_data(r) for r in prefix_runs],
        },
        figure=figure(windows, prefix_runs, max_model_len),
        notes=[
            "Engines in-process (engine_setup.build_engine), greedy, ignore_eos; the module docstring of "
            "benchmarks/suites/kv_memory.py says what each figure counts."
        ],
    )


def _cut(windows: list[WindowRun]) -> str:
    cut = [w.label for w in windows if w.cut_short]
    return f"; CUT SHORT by the time cap before the pool's steady state: {', '.join(cut)}" if cut else ""


def worker_spec(
    model: Path,
    device: str,
    mode: PagedAttentionMode,
    *,
    max_model_len: int,
    max_num_seqs: int,
    memory_bytes: int | None = None,
    prefix_caching: bool = True,
    block_size: int | None = None,
) -> WorkerSpec:
    """The in-process engine's spec for a KV-cache benchmark (also benchmarks/suites/paged_eager.py)."""
    settings = PagedAttentionConfig(memory_bytes=memory_bytes)
    prefix = FeatureMode.AUTO if prefix_caching else FeatureMode.OFF
    if block_size is not None:
        settings = replace(settings, block_size=block_size)
    return WorkerSpec(
        model=str(model),
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        cache=cache_intent(mode, settings),
        features=FeatureIntents(prefix_caching=prefix),
    )


def _requests(items: list[workloads.WorkItem], tag: str) -> list[GenerationRequest]:
    return [greedy_request(f"{tag}-{i}", item.prompt, item.max_tokens) for i, item in enumerate(items)]


def _window(
    label: str,
    spec: WorkerSpec,
    flags: str,
    items: list[workloads.WorkItem],
    budget: int,
    max_model_len: int,
    scale: Scale,
) -> WindowRun:
    """Offer every item at once; record up to window_steps steps (or window_cap_s), then abort the rest."""
    engine = build_engine(spec)
    try:
        log = StepLog.attach(engine, max_model_len)
        finished = _Finished()
        started = time.monotonic()
        for request in _requests(items, label.replace(" ", "").replace(",", "-")):
            engine.submit(request, finished.sink)
        deadline = started + scale.window_cap_s
        while (
            time.monotonic() < deadline
            and len(log.snapshot()) < scale.window_steps
            and finished.count < len(items)
        ):
            time.sleep(0.02)
        seconds = time.monotonic() - started
        num_finished = finished.count
    finally:
        engine.close()  # fails what is still in flight: the window is over
    samples = log.snapshot()
    if not samples:
        raise RuntimeError(f"{label}: no engine step finished within {scale.window_cap_s} s")
    return WindowRun(
        label=label,
        paged=spec.cache.paged is not None,
        flags=f"{flags} --max-model-len {max_model_len}",
        budget_bytes=budget,
        capacity_tokens=engine.realized.capacity_tokens,
        offered=len(items),
        finished=num_finished,
        samples=samples,
        seconds=seconds,
        cut_short=len(samples) < scale.window_steps and num_finished < len(items),
    )


class _Finished:
    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def sink(self, item: GenerationOutput | BaseException) -> None:
        if not isinstance(item, BaseException) and item.finish_reason is not None:
            with self._lock:
                self.count += 1


def _prefix_run(
    ctx: BenchContext, on: bool, shared: list[workloads.WorkItem], max_model_len: int, scale: Scale
) -> PrefixRun:
    spec = worker_spec(
        ctx.model,
        ctx.device,
        PagedAttentionMode.ON,
        max_model_len=max_model_len,
        max_num_seqs=scale.prefix_requests,
        prefix_caching=on,
    )
    engine = build_engine(spec)
    tag = "prefix-on" if on else "prefix-off"
    try:
        engine.run(_requests(shared[:1], f"{tag}-warm"), timeout=scale.run_timeout_s)
        started = time.monotonic()
        results: list[GenerationResult] = engine.run(_requests(shared[1:], tag), timeout=scale.run_timeout_s)
        seconds = time.monotonic() - started
    finally:
        engine.close()
        del engine
        gc.collect()
    return PrefixRun(
        prefix_caching=on,
        requests=len(results),
        prompt_tokens=sum(r.usage.prompt_tokens for r in results),
        cached_tokens=sum(r.usage.cached_prompt_tokens for r in results),
        output_tokens=sum(r.usage.completion_tokens for r in results),
        seconds=seconds,
    )
