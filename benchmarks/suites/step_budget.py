"""The step's token budget (`--max-num-batched-tokens`) against decode stalls, at 1.5x capacity.

    python -m benchmarks.run --suites step_budget [--quick]

A prefill chunk shares its step with every running decode, so a large chunk makes every decoding
stream wait for it: ITL p99 grows with the budget, while a small budget spends more steps on each
prompt (TTFT, throughput). One paged worker behind a router per budget in BUDGETS and one started
without the flag (the default); each gets the same seeded mixed workload (suite `online`'s) arriving
as a Poisson process at 1.5x the capacity measured with the default (a burst, as `online` probes it).

    median decode step   ITL p50 of the same run: nearly every gap between two tokens is one step
    target               p99 ITL <= 2x the median decode step, at the default budget (the worker started
                         without the flag: CPU_DEFAULTS' 2048 a step, at most 48 of them prompt tokens
                         while a sequence decodes); an explicit --max-num-batched-tokens N is N for
                         every step, so the 2048 row is the old default
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

BUDGETS, QUICK_BUDGETS = (2048, 256, 64, 32), (2048,)  # explicit flags; and the default (DEFAULT)
DEFAULT = 0  # the row of the worker started without the flag
LOAD_FACTOR = 1.5
WINDOW_S, QUICK_WINDOW_S = 15.0, 3.0
MAX_REQUESTS, QUICK_MAX_REQUESTS = 24, 8
ITL_LIMIT = 2.0  # p99 ITL / median decode step


@contextmanager
def _worker(
    ctx: BenchContext, budget: int | None, max_model_len: int, probe: list[WorkItem]
) -> Iterator[str]:
    """A router and one paged worker with this step budget (None: no flag, the worker's default), warmed
    by one burst; yields its address."""
    args = () if budget is None else ("--max-num-batched-tokens", str(budget))
    cluster = Cluster(ctx.model, "paged", max_model_len, MAX_NUM_SEQS, worker_args=args).start()
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
    from kvpact.worker.kv.sizing import CPU_DEFAULTS

    config, cap, max_model_len = model_scale(ctx)
    window = QUICK_WINDOW_S if ctx.quick else WINDOW_S
    most = QUICK_MAX_REQUESTS if ctx.quick else MAX_REQUESTS
    probe = _items(
        QUICK_PROBE_REQUESTS if ctx.quick else PROBE_REQUESTS, ctx.seed + 999, config.vocab_size, cap
    )
    default = DEFAULT
    cpu = CPU_DEFAULTS
    described = (
        f"default ({cpu.max_num_batched_tokens}, at most {cpu.prompt_tokens_beside_decodes} prompt tokens "
        "beside decodes)"
    )
    runs: dict[int, tuple[list[Streamed], float]] = {}
    with _worker(ctx, None, max_model_len, probe) as address:  # the default's worker sets the rate
        probed = _timed(address, probe)
        capacity = len(probe) / probed[1]
        rate = round(LOAD_FACTOR * capacity, 3)
        n = max(3, min(most, round(rate * window)))
        items = workloads.with_poisson_arrivals(_items(n, ctx.seed, config.vocab_size, cap), rate, ctx.seed)
        runs[default] = _timed(address, items)
    budgets = [default, *sorted(QUICK_BUDGETS if ctx.quick else BUDGETS, reverse=True)]
    for budget in budgets:
        if budget not in runs:
            with _worker(ctx, budget, max_model_len, probe) as address:
                runs[budget] = _timed(address, items)
    rows: list[list[Any]] = []
    data: list[dict[str, Any]] = []
    base_tok_s = None
    for budget in budgets[1:] + budgets[:1]:  # tok/s against the largest explicit budget
        streamed, wall = runs[budget]
        itl = [g for s in streamed for g in s.inter_token()]
        ttft = [s.ttft for s in streamed]
        tok_s = sum(len(s.tokens) for s in streamed) / wall
        base_tok_s = base_tok_s or tok_s
        p50, p99 = 1000 * _pct(itl, 50), 1000 * _pct(itl, 99)
        rows.append(
            [
                described if budget == default else str(budget),
                p50,
                p99,
                p99 / p50,
                _pct(ttft, 50),
                _pct(ttft, 99),
                tok_s,
                tok_s / base_tok_s,
            ]
        )
        data.append(
            {
                "budget": budget,
                "itl_ms": {50: p50, 99: p99},
                "ttft_s": {50: _pct(ttft, 50), 99: _pct(ttft, 99)},
                "output_tok_s": tok_s,
            }
        )
    command = "python -m benchmarks.run --suites step_budget" + (" --quick" if ctx.quick else "")
    at_default = next(d for d in data if d["budget"] == default)
    ratio = at_default["itl_ms"][99] / at_default["itl_ms"][50]
    first = data[0]
    rows, data = rows[-1:] + rows[:-1], data[-1:] + data[:-1]  # the default's row first
    target = Target(
        f"p99 ITL at {LOAD_FACTOR:g}x capacity, default --max-num-batched-tokens ({described})",
        f"<= {ITL_LIMIT:g}x the median decode step",
        f"{ratio:.2f}x (p99 {at_default['itl_ms'][99]:.0f} ms, "
        f"median step {at_default['itl_ms'][50]:.0f} ms); "
        f"output tok/s {at_default['output_tok_s'] / first['output_tok_s']:.2f}x budget {first['budget']}'s",
        ratio <= ITL_LIMIT,
    )
    table = Table(
        f"Step token budget at {LOAD_FACTOR:g}x capacity (one paged worker, Poisson arrivals)",
        ["--max-num-batched-tokens", "ITL p50 ms", "ITL p99 ms", "p99 / p50", "TTFT p50 s", "TTFT p99 s"]
        + ["output tok/s", f"tok/s vs {budgets[1]}"],
        rows,
        command,
        [
            f"capacity ({described}, a burst of {len(probe)} mixed requests): "
            f"{capacity:.2f} req/s; "
            f"rate {rate:g} req/s, {n} requests, the same for every budget",
            f"mixed workload fitted to {max_model_len} tokens, greedy, ignore_eos, "
            f"--max-num-seqs {MAX_NUM_SEQS}",
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
    budgets = [d["budget"] for d in data]
    for q, marker in ((99, "o"), (50, "s")):
        ax.plot(budgets, [d["itl_ms"][q] for d in data], marker=marker, label=f"ITL p{q}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("--max-num-batched-tokens (tokens per step)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title(f"Decode stalls at {LOAD_FACTOR:g}x capacity (lower is better)")
    ax.legend(fontsize=8)
    return fig
