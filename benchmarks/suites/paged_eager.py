"""Paged against eager, in-process, where each one is at its best or its worst: long prompts (paged
prefill attends on the step's own K/V, worker/kv/paged.py), and more requests than the eager cache has
slots for (what paged attention is for).

    python -m benchmarks.run --suites paged_eager [--quick]

Engines are built in-process through worker/startup/engine_setup.py (what `worker` runs) on CPU, the
paged cache with the torch backend (`--paged-attn on`), the eager one with `--paged-attn off`; greedy,
ignore_eos, every request submitted at once; wall time from the first request to the last token.
Both engines of a case are open at once and alternate, round by round; each keeps its fastest round.

1. long_prompt: benchmarks/workloads.py's long_prompt draw (prompts 512-1,536, outputs 16-128; 4
   requests, 2 in --quick, cut to the model's positions), both caches with --max-num-seqs 32 and the
   same --max-model-len (the offline suite's settings, without the router in between).
2. Out of eager slots: one KV budget, the memory of SLOTS eager sequences at max_model_len. Eager gets
   `--max-num-seqs SLOTS` (that is its cache); paged gets `--pa-memory-bytes <the same bytes>
   --max-num-seqs OFFERED` with OFFERED = OVERSUBSCRIBE x SLOTS requests of fixed length, short enough
   that all of them fit the paged pool at once. Eager runs them SLOTS at a time, in waves; paged runs
   them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import workloads
from benchmarks.framework import BenchContext, SuiteResult, Table, Target, new_figure
from benchmarks.kvpact_systems import WARMUP, run_engine
from benchmarks.peers import Run
from benchmarks.suites.kv_memory import worker_spec
from benchmarks.workloads import WorkItem
from kvpact.shared.intent import PagedAttentionMode
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine.engine import Engine
from kvpact.worker.startup.engine_setup import build_engine, plan_startup

NAME = "paged_eager"
MAX_NUM_SEQS = 32  # the long_prompt runs, as the offline suite
OVERSUBSCRIBE = 4  # requests offered per eager slot in the out-of-slots runs
BLOCK_SIZE = 16  # the paged default: each request is sized to a whole number of blocks, with one spare
GOAL = 1.0  # paged / eager throughput


@dataclass(frozen=True, slots=True)
class Scale:
    long_requests: int
    long_cap: int  # max_model_len cap for long_prompt
    slots: int
    slot_len: int  # max_model_len of the out-of-slots runs
    output_tokens: int
    rounds: int


FULL = Scale(long_requests=4, long_cap=2048, slots=4, slot_len=512, output_tokens=32, rounds=2)
QUICK = Scale(long_requests=2, long_cap=256, slots=2, slot_len=256, output_tokens=8, rounds=1)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    items: list[WorkItem]
    specs: dict[str, WorkerSpec]  # "paged", "eager"
    flags: dict[str, str]

    @property
    def tokens(self) -> int:
        return sum(len(i.prompt) + i.max_tokens for i in self.items)


def run(ctx: BenchContext) -> SuiteResult:
    scale = QUICK if ctx.quick else FULL
    probe = plan_startup(
        worker_spec(ctx.model, ctx.device, PagedAttentionMode.OFF, max_model_len=0, max_num_seqs=1)
    )
    config = probe.model_config
    cases = [
        _long_prompt(ctx, scale, config.vocab_size, config.max_position_embeddings),
        _out_of_slots(ctx, scale, config.vocab_size, config.max_position_embeddings, probe.bytes_per_token),
    ]
    runs: dict[tuple[str, str], Run] = {}
    for case in cases:
        runs.update(_alternating(case, scale.rounds))
    return _report(ctx, cases, runs)


def _long_prompt(ctx: BenchContext, scale: Scale, vocab: int, max_positions: int) -> Case:
    cap = min(scale.long_cap, max_positions)
    items = workloads.fit(workloads.long_prompt(scale.long_requests, ctx.seed, vocab), cap)
    max_model_len = min(max_positions, -(-max(len(i.prompt) + i.max_tokens for i in items) // 64) * 64)
    specs = {
        cache: worker_spec(
            ctx.model, ctx.device, mode, max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS
        )
        for cache, mode in (("paged", PagedAttentionMode.ON), ("eager", PagedAttentionMode.OFF))
    }
    common = f"--max-num-seqs {MAX_NUM_SEQS} --max-model-len {max_model_len}"
    flags = {"paged": f"--paged-attn on {common}", "eager": f"--paged-attn off {common}"}
    return Case("long_prompt", items, specs, flags)


def _out_of_slots(
    ctx: BenchContext, scale: Scale, vocab: int, max_positions: int, bytes_per_token: int
) -> Case:
    max_model_len = min(scale.slot_len, max_positions)
    budget = scale.slots * max_model_len * bytes_per_token  # what eager's slots take
    offered = OVERSUBSCRIBE * scale.slots
    # Each request's prompt + output: its share of the pool, less one spare block (never preempted).
    per_request = (scale.slots * max_model_len) // offered // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
    items = workloads.fixed(offered, ctx.seed, vocab, per_request - scale.output_tokens, scale.output_tokens)
    specs = {
        "paged": worker_spec(
            ctx.model,
            ctx.device,
            PagedAttentionMode.ON,
            max_model_len=max_model_len,
            max_num_seqs=offered,
            memory_bytes=budget,
        ),
        "eager": worker_spec(
            ctx.model,
            ctx.device,
            PagedAttentionMode.OFF,
            max_model_len=max_model_len,
            max_num_seqs=scale.slots,
        ),
    }
    flags = {
        "paged": f"--paged-attn on --pa-memory-bytes {budget} --max-num-seqs {offered} "
        f"--max-model-len {max_model_len}",
        "eager": f"--paged-attn off --max-num-seqs {scale.slots} --max-model-len {max_model_len}",
    }
    return Case(f"{offered} requests, {scale.slots} eager slots", items, specs, flags)


def _alternating(case: Case, rounds: int) -> dict[tuple[str, str], Run]:
    """Both engines open at once, paged then eager each round; each cache's fastest round."""
    best: dict[tuple[str, str], Run] = {}
    with _engine(case.specs["paged"]) as paged, _engine(case.specs["eager"]) as eager:
        for _ in range(rounds):
            for cache, engine in (("paged", paged), ("eager", eager)):
                r = run_engine(engine, case.items)
                key = (case.name, cache)
                if key not in best or r.wall_s < best[key].wall_s:
                    best[key] = r
    return best


def _engine(spec: WorkerSpec) -> Engine:
    engine = build_engine(spec)
    vocab = engine.vocab_size
    run_engine(engine, [WorkItem(tuple(t % vocab for t in w.prompt), w.max_tokens) for w in WARMUP])
    return engine


def _report(ctx: BenchContext, cases: Sequence[Case], runs: dict[tuple[str, str], Run]) -> SuiteResult:
    command = f"python -m benchmarks.run --suites {NAME}" + (" --quick" if ctx.quick else "")
    rows: list[list[Any]] = []
    ratios: dict[str, float] = {}
    identical: dict[str, str] = {}
    for case in cases:
        paged, eager = runs[case.name, "paged"], runs[case.name, "eager"]
        ratios[case.name] = eager.wall_s / paged.wall_s
        same = sum(a == b for a, b in zip(paged.outputs, eager.outputs, strict=True))
        identical[case.name] = f"{same}/{len(case.items)}"
        output = sum(i.max_tokens for i in case.items)
        for cache, r in (("paged", paged), ("eager", eager)):
            rows.append([
                case.name, cache, r.wall_s, output / r.wall_s, case.tokens / r.wall_s, identical[case.name],
                case.flags[cache],
            ])  # fmt: skip
    long_name, slots_name = cases[0].name, cases[1].name
    targets = [
        Target(
            "paged >= eager, long_prompt, in-process (own-K/V prefill)",
            f">= {GOAL:.2f}x eager tok/s",
            f"{ratios[long_name]:.2f}x",
            ratios[long_name] >= GOAL,
            workloads.summary(cases[0].items),
        ),
        Target(
            "paged >= eager where the eager cache runs out of slots (one KV budget)",
            f">= {GOAL:.2f}x eager tok/s",
            f"{ratios[slots_name]:.2f}x ({slots_name})",
            ratios[slots_name] >= GOAL,
            workloads.summary(cases[1].items),
        ),
    ]
    table = Table(
        "Paged vs eager, in-process: long prompts, and more requests than eager slots",
        ["case", "cache", "wall s", "output tok/s", "processed tok/s", "greedy outputs identical", "flags"],
        rows,
        command,
        [
            "greedy, ignore_eos, all requests at once, exactly the requested tokens on both caches; "
            "identical: requests whose greedy tokens agree between the caches (a near-tie in the logits "
            "can resolve differently under another summation order); "
            f"best of {QUICK.rounds if ctx.quick else FULL.rounds} alternating round(s)"
        ],
    )
    fig, (ax,) = new_figure()
    names = [case.name for case in cases]
    ax.bar(range(len(names)), [ratios[n] for n in names])
    ax.axhline(GOAL, color="red", linestyle="--", linewidth=1, label="goal")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("paged / eager tok/s")
    ax.set_title("Paged vs eager (in-process)")
    ax.legend(fontsize=7)
    return SuiteResult(
        NAME,
        [table],
        targets,
        data={
            "ratios": ratios,
            "runs": {
                f"{c}/{cache}": {"wall_s": r.wall_s, "settings": r.settings} for (c, cache), r in runs.items()
            },
            "identical": identical,
            "workloads": {case.name: workloads.summary(case.items) for case in cases},
        },
        figure=fig,
        notes=[__doc__.split("\n\n")[0].replace("\n", " ")],
    )
