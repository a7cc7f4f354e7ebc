"""The kv_memory suite's measured runs, and how they are shown: its tables, raw data and figure
(benchmarks/suites/kv_memory.py measures; this only formats)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks import workloads
from benchmarks.framework import Table, new_figure
from benchmarks.kv_steps import StepSample, eager_peak, paged_peak

MiB = 2**20


@dataclass(slots=True)
class WindowRun:
    """One cache offered the same requests at once, recorded for a bounded number of steps."""

    label: str  # "paged", "paged, block 8", "eager"
    paged: bool
    flags: str  # the worker flags that build this cache
    budget_bytes: int
    capacity_tokens: int
    offered: int
    finished: int
    samples: list[StepSample]
    seconds: float
    cut_short: bool = False  # the time cap ended it before its steps (a loaded machine): figures early

    @property
    def peak(self) -> StepSample:
        return paged_peak(self.samples) if self.paged else eager_peak(self.samples)

    @property
    def peak_running(self) -> int:
        return max(s.running for s in self.samples)

    @property
    def second_half(self) -> list[StepSample]:
        return self.samples[len(self.samples) // 2 :]

    @property
    def sustained_running(self) -> float:
        return statistics.fmean(s.running for s in self.second_half)

    @property
    def step_s(self) -> float:
        """Mean seconds per step over the second half (the pool full, sequences decoding)."""
        half = self.second_half
        return (half[-1].t - half[0].t) / (len(half) - 1) if len(half) > 1 else float("nan")


@dataclass(slots=True)
class PrefixRun:
    prefix_caching: bool
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def processed_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def mib(n: int) -> str:
    return f"{n / MiB:.3g} MiB"


def budget_table(
    runs: list[WindowRun],
    *,
    eager_slots: int,
    max_model_len: int,
    bytes_per_token: int,
    offered: list[workloads.WorkItem],
    command: str,
) -> Table:
    rows = []
    for r in runs:
        peak = r.peak
        rows.append(
            [
                r.label,
                round(r.budget_bytes / MiB, 1),
                r.capacity_tokens,
                r.offered,
                len(r.samples),
                r.peak_running,
                round(r.sustained_running, 1),
                r.samples[-1].preemptions,
                round(100 * peak.fraction, 1),
                peak.blocks_in_use,
                peak.tokens_held,
                peak.allocated_tokens,
                round(r.step_s, 3),
            ]
        )
    budget = runs[0].budget_bytes
    return Table(
        title=(
            f"A fixed KV budget ({mib(budget)} = {eager_slots} eager slots x max_model_len {max_model_len} x "
            f"{bytes_per_token:,} bytes/token), mixed workload offered at once"
        ),
        columns=[
            "cache",
            "budget MiB",
            "capacity tokens",
            "requests offered",
            "steps recorded",
            "peak running",
            "sustained running",
            "preemptions",
            "real tokens at peak %",
            "blocks (slots) in use at peak",
            "tokens held at peak",
            "allocated tokens at peak",
            "s/step (2nd half)",
        ],
        rows=rows,
        command=command,
        notes=[
            f"workload: {workloads.summary(offered)}; the same requests go to every cache",
            *(f"{r.label}: {r.flags}" for r in runs),
            "sustained running = mean running sequences over the second half of the recorded steps (the "
            "pool has filled and the paged scheduler preempts and readmits)",
            "real tokens at peak: paged at the step with the most blocks in use (ties: the lowest "
            "fraction), tokens held / (blocks x block size); eager at the step holding the most tokens, "
            "tokens held / (slots x max_model_len)",
            "each run stops after "
            + ", ".join(
                f"{len(r.samples)} steps ({r.seconds:.0f} s, {r.finished} finished"
                + (", CUT SHORT by the time cap" if r.cut_short else "")
                + ")"
                for r in runs
            )
            + ": the rest are aborted",
        ],
    )


def prefix_table(runs: list[PrefixRun], measured: list[workloads.WorkItem], command: str) -> Table:
    base = next(r for r in runs if not r.prefix_caching)
    rows = [
        [
            "on" if r.prefix_caching else "off (--prefix-caching off)",
            r.requests,
            r.prompt_tokens,
            r.cached_tokens,
            round(100 * r.hit_rate, 1),
            round(r.seconds, 2),
            round(r.processed_tps, 1),
            round(r.output_tps, 1),
            round(base.seconds / r.seconds, 2),
        ]
        for r in runs
    ]
    return Table(
        title="Prefix caching on the shared-prefix workload (paged)",
        columns=[
            "prefix caching",
            "requests",
            "prompt tokens",
            "cached prompt tokens",
            "hit rate %",
            "wall s",
            "processed tok/s",
            "output tok/s",
            "speedup vs off",
        ],
        rows=rows,
        command=command,
        notes=[
            f"workload: {workloads.summary(measured)}, all arriving at once after one warm-up request "
            "with the same system prompt (not timed: the prompt a server has already seen)",
            "both engines: --paged-attn on, the default budget, --max-num-seqs = the number of requests; "
            "hit rate = cached prompt tokens / prompt tokens, from each request's usage",
        ],
    )


def window_data(r: WindowRun) -> dict[str, Any]:
    return {
        "flags": r.flags,
        "budget_bytes": r.budget_bytes,
        "capacity_tokens": r.capacity_tokens,
        "offered": r.offered,
        "finished": r.finished,
        "seconds": r.seconds,
        "peak_running": r.peak_running,
        "sustained_running": r.sustained_running,
        "peak_fraction": r.peak.fraction,
        "step_s": r.step_s,
        "cut_short": r.cut_short,
        "sample_columns": [
            "t",
            "running",
            "waiting",
            "blocks_in_use",
            "allocated_tokens",
            "tokens_held",
            "preemptions",
        ],
        "samples": [
            [
                round(s.t, 3),
                s.running,
                s.waiting,
                s.blocks_in_use,
                s.allocated_tokens,
                s.tokens_held,
                s.preemptions,
            ]
            for s in r.samples
        ],
    }


def prefix_data(r: PrefixRun) -> dict[str, Any]:
    return {
        "prefix_caching": r.prefix_caching,
        "requests": r.requests,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "seconds": r.seconds,
    }


def figure(runs: list[WindowRun], prefix: list[PrefixRun], max_model_len: int) -> Any:
    fig, (ax_run, ax_mem, ax_prefix) = new_figure(3, width=5.0, height=3.8)
    for r in runs:
        ax_run.plot(range(len(r.samples)), [s.running for s in r.samples], label=r.label)
    ax_run.set_title(
        f"running sequences at {mib(runs[0].budget_bytes)} of KV\n(max_model_len {max_model_len})"
    )
    ax_run.set_xlabel("engine step")
    ax_run.set_ylabel("sequences")
    ax_run.legend(fontsize="small")
    for r in runs:
        steps = range(len(r.samples))
        if r.paged:
            ax_mem.plot(steps, [s.allocated_tokens for s in r.samples], ":", label=f"{r.label}: allocated")
        else:
            ax_mem.axhline(
                r.samples[0].allocated_tokens, color="gray", linestyle=":", label="eager: allocated"
            )
        ax_mem.plot(steps, [s.tokens_held for s in r.samples], label=f"{r.label}: real tokens")
    ax_mem.set_title("KV token slots: allocated vs holding tokens")
    ax_mem.set_xlabel("engine step")
    ax_mem.set_ylabel("tokens")
    ax_mem.legend(fontsize="x-small")
    labels = ["prefix cache on" if r.prefix_caching else "off" for r in prefix]
    bars = ax_prefix.bar(labels, [r.processed_tps for r in prefix], color=["tab:green", "tab:gray"])
    for bar, p in zip(bars, prefix, strict=True):
        ax_prefix.annotate(
            f"hit {p.hit_rate:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center"
        )
    ax_prefix.set_title("shared-prefix workload")
    ax_prefix.set_ylabel("processed (prompt + output) tok/s")
    fig.tight_layout()
    return fig
