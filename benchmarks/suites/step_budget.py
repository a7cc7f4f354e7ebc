"""The step's prompt share against decode stalls, at 1.5x capacity.

    python -m benchmarks.run --suites step_budget [--quick]

A prompt chunk shares its step with every running decode, so a large chunk makes every decoding
stream wait for it: ITL p99 grows with the prompt tokens a step carries beside decodes, while a small
share spends more steps on each prompt (TTFT, throughput). One paged worker behind a router per row of
ROWS: the worker started with no flag (the default), the old default (`--max-num-batched-tokens 2048`,
every prompt in one chunk), and `--prompt-tokens-beside-decodes N` for each N in BESIDE; each gets the
same seeded mixed workload (suite `online`'s) arriving as a Poisson process at 1.5x the capacity
measured with the default (a burst, as `online` probes it).

    median decode step   ITL p50 of the same run: nearly every gap between two tokens is one step
    target               p99 ITL <= 2x the median decode step, for the worker started without a flag
                         (CPU_DEFAULTS: 2048 tokens a step, at most `prompt_tokens_beside_decodes` of
                         them prompt tokens while a sequence decodes)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks import workloads
from benchmarks.framework import BenchContext, SuiteResult, Table, Target, new_figure
from benchmarks.kvpact_systems import Cluster, Streamed, stream
from benchmarks.suites.online import (
    MAX_NUM_SEQS,
    PROBE_REQUESTS,
    QUICK_PROBE_REQUESTS,
    _items,
    _pct,
    model_scale,
)
from benchmarks.workloads import WorkItem

BESIDE_FLAG = "--prompt-tokens-beside-decodes"
OLD_DEFAULT = ("--max-num-batched-tokens", "2048")  # no bound beside decodes: every prompt in one chunk
BESIDE, QUICK_BESIDE = (32, 16, 8), ()  # --prompt-tokens-beside-decodes N, one row each
LOAD_FACTOR = 1.5
WINDOW_S, QUICK_WINDOW_S = 15.0, 3.0
MAX_REQUESTS, QUICK_MAX_REQUESTS = 24, 8
MIN_REQUESTS = 12  # a p99 over fewer streams is a handful of gaps (a slow machine's window holds ~6)
ITL_LIMIT = 2.0  # p99 ITL / median decode step


def rows(quick: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(label, worker flags) per row: the default (no flag) first, then the old default, then BESIDE
    without the default's own value (the default row is that one)."""
    from kvpact.worker.kv.sizing import CPU_DEFAULTS

    own = CPU_DEFAULTS.prompt_tokens_beside_decodes
    flagged = [n for n in (QUICK_BESIDE if quick else BESIDE) if n != own]
    return [
        (f"default (at most {own} prompt tokens beside decodes)", ()),
        ("--max-num-batched-tokens 2048 (the old default: no bound)", OLD_DEFAULT),
        *((f"--prompt-tokens-beside-decodes {n}", (BESIDE_FLAG, str(n))) for n in flagged),
    ]


@contextmanager
def _worker(
    ctx: BenchContext, flags: tuple[str, ...], max_model_len: int, probe: list[WorkItem]
) -> Iterator[str]:
    """A router and one paged worker with these flags, warmed by one burst; yields its address."""
    cluster = Cluster(ctx.model, "paged", max_model_len, MAX_NUM_SEQS, worker_args=flags).start()
    try:
        cluster.wait_ready()
        asyncio.run(stream(cluster.address, probe))
        yield cluster.address
    finally:
        cluster.stop()


def _timed(address: str, items: list[WorkItem]) -> tuple[list[Streamed], float]:
    began = time.perf_counter()
    streamed = asyncio.run(stream(address, items))
    return streamed, time.perf_counter() - began


def run(ctx: BenchContext) -> SuiteResult:
    config, cap, max_model_len = model_scale(ctx)
    window = QUICK_WINDOW_S if ctx.quick else WINDOW_S
    most = QUICK_MAX_REQUESTS if ctx.quick else MAX_REQUESTS
    probe = _items(
        QUICK_PROBE_REQUESTS if ctx.quick else PROBE_REQUESTS, ctx.seed + 999, config.vocab_size, cap
    )
    table_rows = rows(ctx.quick)
    runs: list[tuple[list[Streamed], float]] = []
    with _worker(ctx, table_rows[0][1], max_model_len, probe) as address:  # the default sets the rate
        probed = _timed(address, probe)
        capacity = len(probe) / probed[1]
        rate = round(LOAD_FACTOR * capacity, 3)
        n = min(most, max(MIN_REQUESTS, round(rate * window)))
        items = workloads.with_poisson_arrivals(_items(n, ctx.seed, config.vocab_size, cap), rate, ctx.seed)
        runs.append(_timed(address, items))
    for _, flags in table_rows[1:]:
        with _worker(ctx, flags, max_model_len, probe) as address:
            runs.append(_timed(address, items))
    cells: list[list[Any]] = []
    data: list[dict[str, Any]] = []
    old_tok_s = sum(len(s.tokens) for s in runs[1][0]) / runs[1][1]
    for (label, flags), (streamed, wall) in zip(table_rows, runs, strict=True):
        itl = [g for s in streamed for g in s.inter_token()]
        ttft = [s.ttft for s in streamed]
        tok_s = sum(len(s.tokens) for s in streamed) / wall
        p50, p99 = 1000 * _pct(itl, 50), 1000 * _pct(itl, 99)
        cells.append([label, p50, p99, p99 / p50, _pct(ttft, 50), _pct(ttft, 99), tok_s, tok_s / old_tok_s])
        data.append(
            {
                "label": label,
                "flags": list(flags),
                "itl_ms": {50: p50, 99: p99},
                "ttft_s": {50: _pct(ttft, 50), 99: _pct(ttft, 99)},
                "output_tok_s": tok_s,
            }
        )
    command = "python -m benchmarks.run --suites step_budget" + (" --quick" if ctx.quick else "")
    default = data[0]
    ratio = default["itl_ms"][99] / default["itl_ms"][50]
    target = Target(
        f"p99 ITL at {LOAD_FACTOR:g}x capacity, the worker's default ({table_rows[0][0]})",
        f"<= {ITL_LIMIT:g}x the median decode step",
        f"{ratio:.2f}x (p99 {default['itl_ms'][99]:.0f} ms, median step {default['itl_ms'][50]:.0f} ms); "
        f"output tok/s {default['output_tok_s'] / old_tok_s:.2f}x the old default's, "
        f"TTFT p99 {default['ttft_s'][99]:.2f} s",
        ratio <= ITL_LIMIT,
    )
    table = Table(
        f"Prompt tokens beside decodes at {LOAD_FACTOR:g}x capacity (one paged worker, Poisson arrivals)",
        ["worker flags", "ITL p50 ms", "ITL p99 ms", "p99 / p50", "TTFT p50 s", "TTFT p99 s"]
        + ["output tok/s", "tok/s vs the old default"],
        cells,
        command,
        [
            f"capacity (the default, a burst of {len(probe)} mixed requests): {capacity:.2f} req/s; "
            f"rate {rate:g} req/s, {n} requests, the same for every row",
            f"mixed workload fitted to {max_model_len} tokens, greedy, ignore_eos, "
            f"--max-num-seqs {MAX_NUM_SEQS}; rows run one after another (a load change mid-run shows as "
            "a row's difference)",
        ],
    )
    return SuiteResult(
        suite="step_budget",
        tables=[table],
        targets=[target],
        data={"capacity_req_s": capacity, "rate_req_s": rate, "runs": data},
        figure=_figure(data),
    )


def _figure(data: list[dict]):
    fig, (ax,) = new_figure(width=6.5, height=4.0)
    labels = [d["label"].split(" (")[0].replace("--prompt-tokens-beside-decodes ", "beside ") for d in data]
    x = range(len(data))
    for q, marker in ((99, "o"), (50, "s")):
        ax.plot(x, [d["itl_ms"][q] for d in data], marker=marker, linestyle="", label=f"ITL p{q}")
    ax.set_xticks(list(x), labels, fontsize=7, rotation=15)
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title(f"Decode stalls at {LOAD_FACTOR:g}x capacity (lower is better)")
    ax.legend(fontsize=8)
    return fig
