"""Offline throughput: kvpact (paged and eager; in-process and through a router + worker) against
transformers (`generate` as one padded batch and in batches of 8, and its continuous batching), with
the machine's compute bound measured in the same run.

    python -m benchmarks.run --suites offline [--quick]

Workloads (benchmarks/workloads.py, seeded, greedy, ignore_eos): mixed (32 requests, prompts 32-256,
outputs 16-256), long_prompt (prompts 512-1,536) and shared_prefix (a common 768-token system prompt),
each submitted all at once. Every system generates exactly the same tokens per request, so

    output tok/s     = requested output tokens / wall time (first request sent -> last token)
    processed tok/s  = (prompt + output tokens) / the same wall time (padding is never counted)
    % of bound       = processed tok/s / compute bound (benchmarks/compute_bound.py)

Every kvpact row but one runs the throughput step budget (`--max-num-batched-tokens 2048`, THROUGHPUT_BUDGET):
these are batch jobs. The server's default budget is ITL-first (on the CPU at most 12 prompt tokens in a
step that carries decodes; the online and step_budget suites judge it), and a burst pays for it: the row
"paged, router + worker, server default budget" shows what, on the mixed workload. vLLM makes the same
split (its offline `LLM` class takes a larger default budget than its API server).

Wall times exclude loading and a short warm-up of each system. The kvpact comparisons (served against
in-process, paged against eager) are judged over ROUNDS rounds (2 in --quick): each round runs every one
of those systems once on the workload, its prompts shifted by the round (the same lengths, so the same
work, and no round served from an earlier round's prefix cache), served ones first in even rounds and
in-process ones first in odd ones. A ratio is the median of its per-round ratios, each from two runs a
minute apart: one run on this shared 2-core host moves by tens of percent (the same in-process mixed run
took 33-46 s within an hour), far more than the 5% a target judges. The tables show each system's median
wall time and every round's; transformers runs once (its ratios use kvpact's median), and the agreement
table compares round 0, whose prompts are the workload's own. The two in-process engines run on one
copy of the weights (`share_weights`), so their ratio is the caches' alone; the served workers each
load their own. Two hand-started workers against one
(`shared_machine`) is judged the same way, over SHARED_ROUNDS rounds (1 in --quick); then the two-worker
tier runs the load once more and one worker is sent SIGTERM mid-load (`shared_drain`). Served against
in-process is also judged at `--max-num-seqs 1` (the mixed draw's first ONE_SEQ_REQUESTS, ONE_SEQ_ROUNDS
rounds; issue 25 asks it to hold at 1 and 32), on a router + worker and an engine of its own. The router +
worker runs go through real processes and a streaming client (kvpact.client.AsyncClient, token ids
in, token ids out). Greedy outputs are compared with transformers' one padded batch token by token
(same dequantized weights, fp32): the agreement table says how many requests match exactly and where
the others first differ.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from benchmarks import compute_bound, peers, workloads
from benchmarks.framework import BenchContext, SuiteResult, Table, Target, new_figure
from benchmarks.kvpact_systems import (
    RUN_TIMEOUT_S,
    Cluster,
    open_engine,
    run_engine,
    share_weights,
    stream_run,
)
from benchmarks.peers import Run
from benchmarks.router_tier import cpu_seconds, thread_cpu_seconds
from benchmarks.workloads import WorkItem
from kvpact.client import AsyncClient
from kvpact.deploy.processes import wait_for_exit
from kvpact.worker.loader.load import read_model_config
from kvpact.worker.options import DEFAULT_DRAIN_TIMEOUT_S

ROUTER_PAGED = "kvpact paged, router + worker"
ROUTER_PAGED_DEFAULT = "kvpact paged, router + worker, server default budget"
ROUTER_EAGER = "kvpact eager, router + worker"
INPROC_PAGED = "kvpact paged, in-process"
INPROC_EAGER = "kvpact eager, in-process"
HF_PADDED = "transformers generate, one padded batch"
HF_BATCH8 = "transformers generate, batches of 8"
HF_CB = "transformers continuous batching"
SYSTEMS = (
    ROUTER_PAGED,
    ROUTER_PAGED_DEFAULT,
    ROUTER_EAGER,
    INPROC_PAGED,
    INPROC_EAGER,
    HF_PADDED,
    HF_BATCH8,
    HF_CB,
)
ROUNDS = 5  # of each kvpact system in REPEATED, per workload (--quick: 2)
SHARED_ROUNDS = 5  # of the two-workers-vs-one comparison (--quick: 1)
ONE_SEQ_ROUNDS, ONE_SEQ_REQUESTS = 4, 8  # served vs in-process at --max-num-seqs 1: the mixed draw's first 8
REPEATED = (ROUTER_PAGED, ROUTER_EAGER, INPROC_PAGED, INPROC_EAGER)  # the systems the kvpact ratios compare
MAX_NUM_SEQS = 32
THROUGHPUT_BUDGET = 2048  # --max-num-batched-tokens for the batch rows (an explicit budget: no ITL bound)
GOAL_BOUND = 0.60  # issue 13: mixed, router + worker, paged
# Issue 25, on every workload, router + worker with --paged-attn on:
GOAL_SERVED = 0.95  # of the same engine in-process
GOAL_OF_CEILING = 0.9  # vs one padded batch, of its ceiling (padded tokens / useful tokens)
GOAL_VS_CB = 1.6  # vs transformers' continuous batching
GOAL_SHARED = 0.9  # issue 25, target 0: two workers sharing the machine deliver what one alone does


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    items: list[WorkItem]
    systems: tuple[str, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(i.prompt) for i in self.items)

    @property
    def output_tokens(self) -> int:
        return sum(i.max_tokens for i in self.items)


def plan(ctx: BenchContext, vocab_size: int, max_positions: int) -> list[Workload]:
    """Sized so the full suite stays near its 9-minute budget on the bundled model: mixed keeps the issue's
    32 requests and every system; long_prompt (4 requests) and shared_prefix (8) run kvpact through the
    router (paged and eager: the paged >= eager target), paged in-process (served vs in-process) and
    transformers' padded batch and continuous batching."""
    others = (ROUTER_PAGED, ROUTER_EAGER, INPROC_PAGED, HF_PADDED, HF_CB)
    if ctx.quick:
        sizes, cap = {"mixed": 4, "long_prompt": 2, "shared_prefix": 3}, min(max_positions, 96)
    else:
        sizes, cap = {"mixed": 32, "long_prompt": 4, "shared_prefix": 8}, max_positions
    draws = {"mixed": workloads.mixed, "long_prompt": workloads.long_prompt}
    result = []
    for name, n in sizes.items():
        if name == "shared_prefix":
            prefix = min(workloads.SHARED_PREFIX_TOKENS, cap // 2)
            items = workloads.shared_prefix(n, ctx.seed, vocab_size, prefix_tokens=prefix)
        else:
            items = draws[name](n, ctx.seed, vocab_size)
        result.append(Workload(name, workloads.fit(items, cap), SYSTEMS if name == "mixed" else others))
    return result


def run(ctx: BenchContext) -> SuiteResult:
    config = read_model_config(ctx.model)
    plans = plan(ctx, config.vocab_size, config.max_position_embeddings)
    longest = max(len(i.prompt) + i.max_tokens for w in plans for i in w.items)
    max_model_len = min(config.max_position_embeddings, -(-longest // 64) * 64)
    runs: dict[tuple[str, str], list[Run]] = {}  # every round's run, round 0 first
    with ExitStack() as stack:
        clusters = {}
        budget = ("--max-num-batched-tokens", str(THROUGHPUT_BUDGET))
        configs: list[tuple[str, str, tuple[str, ...]]] = [
            (ROUTER_PAGED, "paged", budget),
            (ROUTER_EAGER, "eager", budget),
            (ROUTER_PAGED_DEFAULT, "paged", ()),
        ]
        for system, cache, flags in configs:  # all start at once (loading overlaps), run one at a time
            cluster = Cluster(ctx.model, cache, max_model_len, MAX_NUM_SEQS, worker_args=flags).start()
            stack.callback(cluster.stop)
            clusters[system] = cluster
        hf_model = peers.load_transformers_model(ctx.model)
        parameters = compute_bound.count_parameters(hf_model)
        for cluster in clusters.values():
            cluster.wait_ready()
        bound_seconds = 1.0 if ctx.quick else 3.0
        bounds = [compute_bound.measure(parameters, seconds=bound_seconds)]
        engines = {
            system: stack.enter_context(
                open_engine(ctx.model, cache, max_model_len, MAX_NUM_SEQS, THROUGHPUT_BUDGET)
            )
            for cache, system in (("paged", INPROC_PAGED), ("eager", INPROC_EAGER))
        }
        share_weights(engines[INPROC_EAGER], engines[INPROC_PAGED])  # in-process: the caches alone differ
        # Workload by workload and round by round, every served system and every in-process one back to
        # back (which goes first alternates): this shared machine's speed drifts by tens of percent over
        # minutes, so each ratio pairs runs a minute apart, round by round.
        for w in plans:
            for r in range(2 if ctx.quick else ROUNDS):
                items = shifted_prompts(w.items, r, config.vocab_size)
                served = [(s, partial(stream_run, c.address)) for s, c in clusters.items()]
                local = [(s, partial(run_engine, e)) for s, e in engines.items()]
                for group in (served, local) if r % 2 == 0 else (local, served):
                    for system, run_on in group:
                        if system in w.systems and (r == 0 or system in REPEATED):
                            runs.setdefault((w.name, system), []).append(run_on(items))
    shared_rounds = 1 if ctx.quick else SHARED_ROUNDS
    shared = shared_machine(ctx.model, plans[0].items, max_model_len, ctx.quick, shared_rounds)
    drained = shared_drain(ctx.model, plans[0].items, max_model_len, ctx.quick)
    one_seq = served_against_in_process(
        ctx.model, plans[0].items[:ONE_SEQ_REQUESTS], max_model_len, 1, 1 if ctx.quick else ONE_SEQ_ROUNDS
    )
    warm = [WorkItem(item.prompt[:16], 4) for item in plans[0].items[:2]]
    peers.generate_padded(hf_model, warm, 2)  # warm-up
    for w in plans:
        runs[w.name, HF_PADDED] = [peers.generate_padded(hf_model, w.items, len(w.items))]
        if HF_BATCH8 in w.systems:
            runs[w.name, HF_BATCH8] = [peers.generate_padded(hf_model, w.items, 8)]
        runs[w.name, HF_CB] = [peers.generate_continuous(hf_model, w.items)]
    bounds.append(compute_bound.measure(parameters, seconds=bound_seconds))
    return report(ctx, plans, runs, bounds, max_model_len, shared, drained, one_seq)


def shifted_prompts(items: Sequence[WorkItem], round_: int, vocab_size: int) -> list[WorkItem]:
    """Round `round_`'s prompts: every token id shifted by the round (round 0: the workload's own)."""
    if round_ == 0:
        return list(items)
    return [replace(i, prompt=tuple((t + 7 * round_) % vocab_size for t in i.prompt)) for i in items]


def median_wall(rounds: Sequence[Run]) -> float:
    return statistics.median(r.wall_s for r in rounds)


def speedup(runs: dict[tuple[str, str], list[Run]], workload: str, system: str, peer: str) -> float:
    """How many times faster `system` ran `workload` than `peer` (peer's wall / system's): the median of the
    per-round ratios where both ran several rounds, else the ratio of their median walls."""
    mine, theirs = runs[workload, system], runs[workload, peer]
    if min(len(mine), len(theirs)) == 1:
        return median_wall(theirs) / median_wall(mine)
    return statistics.median(b.wall_s / a.wall_s for a, b in zip(mine, theirs, strict=False))


def _each_round(runs: dict[tuple[str, str], list[Run]], workload: str, system: str, peer: str) -> str:
    pairs = zip(runs[workload, system], runs[workload, peer], strict=False)
    return " / ".join(f"{b.wall_s / a.wall_s:.2f}" for a, b in pairs)


@dataclass(frozen=True, slots=True)
class ServedRound:
    """One round of `served_against_in_process`: each side's wall, and the CPU seconds each thread spent
    during its run (largest first): the router's and the worker's threads during the served run, this
    process's during the in-process run (the engine's threads and the caller's loop); `client_cpu_s`
    is this process's during the served run (the streaming client)."""

    served_s: float
    in_process_s: float
    served_threads_cpu_s: dict[str, list[float]]  # "router", the worker's id -> its threads' CPU-s
    in_process_threads_cpu_s: list[float]
    client_cpu_s: float


def _threads_cpu_s(before: dict[int, float], after: dict[int, float]) -> list[float]:
    return sorted((cpu - before.get(tid, 0.0) for tid, cpu in after.items()), reverse=True)


def served_against_in_process(
    model: Path, items: Sequence[WorkItem], max_model_len: int, max_num_seqs: int, rounds: int
) -> list[ServedRound]:
    """Served (a router + paged worker) against the same engine in-process, both at `max_num_seqs` and the
    throughput budget, on `items`, which goes first alternating, round r's prompts shifted by r
    (`shifted_prompts`); each side's threads' CPU read from /proc around its run."""
    vocab_size = read_model_config(model).vocab_size
    budget = ("--max-num-batched-tokens", str(THROUGHPUT_BUDGET))
    cluster = Cluster(model, "paged", max_model_len, max_num_seqs, worker_args=budget).start()
    result = []
    try:
        cluster.wait_ready()
        pids = {handle.name: handle.pid for handle in cluster.handles}
        with open_engine(model, "paged", max_model_len, max_num_seqs, THROUGHPUT_BUDGET) as engine:
            for r in range(rounds):
                shifted = shifted_prompts(items, r, vocab_size)
                for side in ("served", "in-process") if r % 2 == 0 else ("in-process", "served"):
                    if side == "served":
                        before = {name: thread_cpu_seconds(pid) for name, pid in pids.items()}
                        client = cpu_seconds(os.getpid())
                        served_s = stream_run(cluster.address, shifted).wall_s
                        client = cpu_seconds(os.getpid()) - client
                        served = {
                            n: _threads_cpu_s(before[n], thread_cpu_seconds(p)) for n, p in pids.items()
                        }
                    else:
                        mine = thread_cpu_seconds(os.getpid())
                        in_process_s = run_engine(engine, shifted).wall_s
                        local = _threads_cpu_s(mine, thread_cpu_seconds(os.getpid()))
                result.append(ServedRound(served_s, in_process_s, served, local, client))
    finally:
        cluster.stop()
    return result


def shared_load(items: Sequence[WorkItem], quick: bool) -> tuple[list[WorkItem], list[WorkItem]]:
    """The shared-machine case's requests (6 x 48 tokens; 4 x 16 in --quick) and its warm-up requests."""
    n, tokens = (4, 16) if quick else (6, 48)
    load = [WorkItem(item.prompt[:64], tokens) for item in items[:n]]
    return load, [WorkItem(item.prompt[:16], 4) for item in load]


def shared_machine(
    model: Path,
    items: Sequence[WorkItem],
    max_model_len: int,
    quick: bool,
    rounds: int = 1,
    worker_args: tuple[str, ...] = (),
) -> dict[int, list[Run]]:
    """The README's multi-worker case as an operator runs it: one router and N hand-started workers on this
    machine, no thread flags, the same requests (6 x 48 tokens, ignore_eos; 4 x 16 in --quick) spread over
    them, after two short warm-up requests per worker. {num_workers: each round's run}; N = 1 is the worker
    alone. Each round starts both tiers afresh, one worker first in even rounds and two in odd ones: the
    load lasts a few seconds, so one run moves by tens of percent on a shared host. `worker_args`: more
    flags for every worker (`--dtype bfloat16`)."""
    load, warm = shared_load(items, quick)
    result: dict[int, list[Run]] = {1: [], 2: []}
    for r in range(rounds):
        for num_workers in (1, 2) if r % 2 == 0 else (2, 1):
            cluster = Cluster(
                model, "paged", max_model_len, MAX_NUM_SEQS, num_workers=num_workers, worker_args=worker_args
            )
            try:
                cluster.start().wait_ready()
                stream_run(cluster.address, warm[: 2 * num_workers])
                result[num_workers].append(stream_run(cluster.address, load))
            finally:
                cluster.stop()
    return result


@dataclass(frozen=True, slots=True)
class Drained:
    """Target 0's drain, as `shared_drain` saw it: one of two hand-started workers sent SIGTERM while the
    load's requests were in flight on both."""

    exit_code: int
    seconds: float  # SIGTERM -> the process gone
    drain_timeout_s: float  # the worker's --drain-timeout (its default: the case runs no flags)
    on_worker: int  # the load's requests that worker was serving when it was told to stop
    completed: int  # of those, the ones that delivered every token
    failed: int  # streams of the whole load that ended in an error
    requests: int

    @property
    def met(self) -> bool:
        return (
            self.exit_code == 0
            and self.seconds <= self.drain_timeout_s
            and 0 < self.on_worker == self.completed
            and self.failed == 0
        )

    def line(self) -> str:
        return (
            f"exit {self.exit_code} {self.seconds:.1f} s after SIGTERM (--drain-timeout "
            f"{self.drain_timeout_s:g} s); {self.completed} of its {self.on_worker} in-flight requests "
            f"delivered every token; {self.failed} of the {self.requests} streams failed"
        )


def shared_drain(model: Path, items: Sequence[WorkItem], max_model_len: int, quick: bool) -> Drained:
    """The shared-machine case's two-worker tier, once more: its load sent, and the second worker sent
    SIGTERM once every request had its first token (each worker then holds its share in flight)."""
    load, warm = shared_load(items, quick)
    cluster = Cluster(model, "paged", max_model_len, MAX_NUM_SEQS, num_workers=2)
    try:
        cluster.start().wait_ready()
        stream_run(cluster.address, warm[:4])
        return asyncio.run(_drain_during(cluster, load))
    finally:
        cluster.stop()


async def _drain_during(cluster: Cluster, load: Sequence[WorkItem]) -> Drained:
    worker = cluster.handles[2]  # the router, then the workers in order; a handle is named by its worker id
    served_by = [""] * len(load)  # each request's worker, from its chunks
    num_tokens = [0] * len(load)
    all_started = asyncio.Event()

    async def one(client: AsyncClient, k: int) -> None:
        item = load[k]
        tokens = item.max_tokens
        stream = client.generate(list(item.prompt), max_tokens=tokens, temperature=0, ignore_eos=True)
        async for chunk in stream:
            served_by[k] = chunk.worker_id or served_by[k]
            num_tokens[k] += len(chunk.token_ids)
            if all(num_tokens):
                all_started.set()

    async with AsyncClient(cluster.address, timeout=RUN_TIMEOUT_S) as client:
        tasks = [asyncio.create_task(one(client, k)) for k in range(len(load))]
        started = asyncio.create_task(all_started.wait())
        pending: set[asyncio.Task[object]] = {started, *tasks}
        while not started.done():  # woken by the event, a stream that ended, or the timeout
            done, pending = await asyncio.wait(
                pending, timeout=RUN_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
            if not done or pending == {started} or any(t.exception() for t in done if t is not started):
                break
        if not started.done():  # a stream failed, or not every one started, before the signal
            for task in (started, *tasks):
                task.cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            raise RuntimeError(f"the shared-machine load did not get under way before its drain: {got}")
        sent = time.perf_counter()
        worker.popen.send_signal(signal.SIGTERM)
        exit_code = await asyncio.to_thread(wait_for_exit, worker, DEFAULT_DRAIN_TIMEOUT_S + 30)
        seconds = time.perf_counter() - sent
        got = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [isinstance(g, BaseException) for g in got]
    mine = [k for k in range(len(load)) if served_by[k] == worker.name]
    return Drained(
        exit_code,
        seconds,
        DEFAULT_DRAIN_TIMEOUT_S,
        on_worker=len(mine),
        completed=sum(1 for k in mine if not failed[k] and num_tokens[k] == load[k].max_tokens),
        failed=sum(failed),
        requests=len(load),
    )


def shared_rounds(shared: dict[int, list[Run]]) -> list[float]:
    """Two workers' output tok/s over one's, round by round (both tiers ran the same requests, so tok/s
    ratios are wall ratios)."""
    return [one.wall_s / two.wall_s for one, two in zip(shared[1], shared[2], strict=True)]


def shared_ratio(shared: dict[int, list[Run]]) -> float:
    """The median of `shared_rounds`."""
    return statistics.median(shared_rounds(shared))


def _command(ctx: BenchContext) -> str:
    return "python -m benchmarks.run --suites offline" + (" --quick" if ctx.quick else "")


def report(
    ctx: BenchContext,
    plans: Sequence[Workload],
    runs: dict[tuple[str, str], list[Run]],
    bounds: Sequence[compute_bound.ComputeBound],
    max_model_len: int,
    shared: dict[int, list[Run]],
    drained: Drained,
    one_seq: list[ServedRound],
) -> SuiteResult:
    bound = max(bounds, key=lambda b: b.flops_per_s)
    command = _command(ctx)
    tables, data_runs = [], []
    for w in plans:
        reference = median_wall(runs[w.name, HF_PADDED])
        rows = []
        for system in w.systems:
            rounds = runs[w.name, system]
            wall = median_wall(rounds)
            processed = (w.prompt_tokens + w.output_tokens) / wall
            rows.append(
                [
                    system,
                    wall,
                    w.output_tokens / wall,
                    processed,
                    f"{processed / bound.tokens_per_s:.0%}",
                    f"{reference / wall:.2f}x",
                    ", ".join(f"{r.wall_s:.1f}" for r in rounds),
                ]
            )
            data_runs.append(
                {
                    "workload": w.name,
                    "system": system,
                    "wall_s": wall,
                    "round_wall_s": [r.wall_s for r in rounds],
                    "output_tok_s": w.output_tokens / wall,
                    "processed_tok_s": processed,
                    "fraction_of_bound": processed / bound.tokens_per_s,
                    "settings": rounds[0].settings,
                }
            )
        notes = [workloads.summary(w.items), f"the compute bound: {bound.line()}"]
        notes.append("wall s: the median of the system's rounds (each round's in the last column)")
        notes += [f"{s}: {runs[w.name, s][0].settings}" for s in w.systems]
        tables.append(
            Table(
                f"Offline throughput, {w.name} workload",
                [
                    "system",
                    "wall s",
                    "output tok/s",
                    "processed tok/s",
                    "of compute bound",
                    "vs padded generate",
                    "each round's wall s",
                ],
                rows,
                command,
                notes,
            )
        )
    output_tokens = sum(len(o) for o in shared[1][0].outputs)
    shared_tokens = {k: output_tokens / median_wall(r) for k, r in shared.items()}
    each_ratio = shared_rounds(shared)
    tables.append(
        Table(
            "Workers sharing this machine (router + N hand-started paged workers, no thread flags)",
            ["workers", "wall s (median)", "output tok/s", "each round's wall s"],
            [
                [k, median_wall(shared[k]), shared_tokens[k], ", ".join(f"{r.wall_s:.1f}" for r in shared[k])]
                for k in sorted(shared)
            ],
            command,
            [
                f"{len(shared[1][0].outputs)} requests of {len(shared[1][0].outputs[0])} tokens "
                "(ignore_eos), all at once, after two 4-token warm-up requests per worker; each worker sizes "
                "its CPU threads to its share (worker/engine/cpu_share.py)",
                f"{len(each_ratio)} round(s), each starting both tiers afresh (one worker first in even "
                "rounds, two in odd ones); two / one, each round's: "
                + " / ".join(f"{x:.2f}" for x in each_ratio),
                f"drained: the two-worker tier once more, its second worker sent SIGTERM once every request "
                f"had its first token: {drained.line()}",
            ],
        )
    )
    agreement_rows, agreement = _agreement(plans, runs)
    tables.append(
        Table(
            "Greedy agreement with transformers' one padded batch (token by token)",
            ["workload", "system", "requests identical", "first divergence at (token index, of length)"],
            agreement_rows,
            command,
            [
                "the same dequantized weights in fp32 on both sides; a divergence is a near-tie in the logits"
                " resolved differently by another summation order, after which the continuations differ"
            ],
        )
    )
    tables.append(
        Table(
            "Compute bound (measured at the start and the end of the run; the higher is used)",
            ["when", "GFLOP/s (fp32 matmul)", "parameters (M)", "threads", "bound tok/s"],
            [
                [when, b.flops_per_s / 1e9, b.parameters / 1e6, b.threads, b.tokens_per_s]
                for when, b in zip(("start", "end"), bounds, strict=False)
            ],
            command,
        )
    )
    return SuiteResult(
        suite="offline",
        tables=tables,
        targets=[
            *_targets(plans, runs, bound),
            _one_seq_target(one_seq, min(len(plans[0].items), ONE_SEQ_REQUESTS)),
            _shared_target(shared),
            _drain_target(drained),
        ],
        data={
            "runs": data_runs,
            "agreement": agreement,
            "compute_bound": [
                {"flops_per_s": b.flops_per_s, "parameters": b.parameters, "tokens_per_s": b.tokens_per_s}
                for b in bounds
            ],
            "max_model_len": max_model_len,
            "max_num_seqs": MAX_NUM_SEQS,
            "rounds": 2 if ctx.quick else ROUNDS,
            "shared_machine": {
                str(k): {"round_wall_s": [r.wall_s for r in runs_k], "output_tok_s": shared_tokens[k]}
                for k, runs_k in shared.items()
            },
            "shared_machine_drain": asdict(drained),
            "one_sequence_rounds": [asdict(r) for r in one_seq],
            "torch_threads": torch.get_num_threads(),
            "workloads": {w.name: workloads.summary(w.items) for w in plans},
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        figure=_figure(plans, runs, bound),
        notes=[
            f"max_model_len {max_model_len}, --max-num-seqs {MAX_NUM_SEQS} for both kvpact caches, "
            f"--max-num-batched-tokens {THROUGHPUT_BUDGET} (the throughput budget) for every kvpact row but "
            f"'{ROUTER_PAGED_DEFAULT}' (the worker's default: ITL-first); "
            f"fp32, {torch.get_num_threads()} torch threads everywhere; transformers under "
            "torch.inference_mode with SDPA attention."
        ],
    )


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _agreement(
    plans: Sequence[Workload], runs: dict[tuple[str, str], list[Run]]
) -> tuple[list[list], list[dict]]:
    rows, data = [], []
    for w in plans:
        ref = runs[w.name, HF_PADDED][0].outputs
        for system in w.systems:
            if system == HF_PADDED:
                continue
            got = runs[w.name, system][0].outputs  # round 0: the workload's own prompts
            firsts = [_first_divergence(a, b) for a, b in zip(got, ref, strict=True)]
            same = sum(1 for f in firsts if f is None)
            where = [f"{f}/{w.items[i].max_tokens}" for i, f in enumerate(firsts) if f is not None]
            rows.append([w.name, system, f"{same}/{len(ref)}", ", ".join(where) or "-"])
            data.append(
                {"workload": w.name, "system": system, "identical": same, "of": len(ref), "first": firsts}
            )
    return rows, data


def padded_ceiling(items: Sequence[WorkItem]) -> float:
    """What a system that computes only useful tokens can gain on a compute-bound machine over one padded
    batch: the tokens that batch computes (every row padded to the longest prompt, run for the longest
    output) / the useful ones."""
    width, new = max(len(i.prompt) for i in items), max(i.max_tokens for i in items)
    return len(items) * (width + new) / sum(len(i.prompt) + i.max_tokens for i in items)


def _targets(
    plans: Sequence[Workload], runs: dict[tuple[str, str], list[Run]], bound: compute_bound.ComputeBound
) -> list[Target]:
    mixed = next(w for w in plans if w.name == "mixed")
    fraction = (mixed.prompt_tokens + mixed.output_tokens) / median_wall(runs["mixed", ROUTER_PAGED])
    fraction /= bound.tokens_per_s
    paged_vs_eager = {w.name: speedup(runs, w.name, ROUTER_PAGED, ROUTER_EAGER) for w in plans}
    in_process = {
        w.name: speedup(runs, w.name, INPROC_PAGED, INPROC_EAGER) for w in plans if INPROC_EAGER in w.systems
    }
    served = {w.name: speedup(runs, w.name, ROUTER_PAGED, INPROC_PAGED) for w in plans}
    served_eager = {
        w.name: speedup(runs, w.name, ROUTER_EAGER, INPROC_EAGER) for w in plans if INPROC_EAGER in w.systems
    }
    ceiling = {w.name: padded_ceiling(w.items) for w in plans}
    vs_padded = {w.name: speedup(runs, w.name, ROUTER_PAGED, HF_PADDED) for w in plans}
    vs_cb = {w.name: speedup(runs, w.name, ROUTER_PAGED, HF_CB) for w in plans}
    default_cost = speedup(runs, "mixed", ROUTER_PAGED_DEFAULT, ROUTER_PAGED)

    def each(values: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.2f}x" for k, v in values.items())

    def rounds(system: str, peer: str) -> str:
        return "; ".join(f"{w.name} {_each_round(runs, w.name, system, peer)}" for w in plans)

    return [
        Target(
            "served >= in-process on every offline workload (paged, router + worker / in-process, tok/s)",
            f">= {GOAL_SERVED:.2f}x on each",
            each(served),
            all(v >= GOAL_SERVED for v in served.values()),
            f"median of {len(runs['mixed', ROUTER_PAGED])} rounds, each round's:"
            f" {rounds(ROUTER_PAGED, INPROC_PAGED)}; eager: {each(served_eager)}; at the server default"
            " budget (ITL-first) the mixed burst runs"
            f" {default_cost:.2f}x the throughput budget's tok/s",
        ),
        Target(
            "vs transformers' one padded batch, of its ceiling (router + worker, paged)",
            f">= {GOAL_OF_CEILING:.1f}x the ceiling on each",
            ", ".join(
                f"{k} {vs_padded[k]:.2f}x of {ceiling[k]:.2f}x ({vs_padded[k] / ceiling[k]:.2f})"
                for k in ceiling
            ),
            all(vs_padded[k] >= GOAL_OF_CEILING * ceiling[k] for k in ceiling),
            "ceiling = the padded batch's tokens (each row: longest prompt + longest output) / useful tokens",
        ),
        Target(
            "vs transformers continuous batching (router + worker, paged)",
            f">= {GOAL_VS_CB}x on each",
            each(vs_cb),
            all(v >= GOAL_VS_CB for v in vs_cb.values()),
        ),
        Target(
            "offline mixed, router + worker, paged: processed tokens / compute bound",
            f">= {GOAL_BOUND:.0%}",
            f"{fraction:.0%}",
            fraction >= GOAL_BOUND,
            f"bound {bound.tokens_per_s:,.0f} tok/s",
        ),
        Target(
            "paged >= eager on every offline workload (router + worker)",
            ">= 1.00x on each",
            each(paged_vs_eager),
            all(v >= 1.0 for v in paged_vs_eager.values()),
            f"each round's: {rounds(ROUTER_PAGED, ROUTER_EAGER)}; in-process: {each(in_process)}",
        ),
    ]


def _one_seq_target(one_seq: list[ServedRound], requests: int) -> Target:
    ratios = [r.in_process_s / r.served_s for r in one_seq]
    ratio = statistics.median(ratios)
    return Target(
        "served >= in-process at --max-num-seqs 1 (paged, router + worker / in-process, tok/s)",
        f">= {GOAL_SERVED:.2f}x",
        f"{ratio:.2f}x (median of {len(ratios)} rounds, each round's: "
        + " / ".join(f"{x:.2f}" for x in ratios)
        + f"; the mixed draw's first {requests} requests, one sequence a step)",
        ratio >= GOAL_SERVED,
    )


def _shared_target(shared: dict[int, list[Run]]) -> Target:
    ratio = shared_ratio(shared)
    each = " / ".join(f"{x:.2f}" for x in shared_rounds(shared))
    return Target(
        "two hand-started workers on this machine vs one alone (output tok/s, no thread flags)",
        f">= {GOAL_SHARED}x",
        f"{ratio:.2f}x (median of {len(shared[1])} rounds, each round's: {each})",
        ratio >= GOAL_SHARED,
    )


def _drain_target(drained: Drained) -> Target:
    return Target(
        "a worker sent SIGTERM in that setup finishes its in-flight requests within --drain-timeout",
        "exit 0 within --drain-timeout, every one of its streams complete, none failed",
        drained.line(),
        drained.met,
    )


def _figure(
    plans: Sequence[Workload], runs: dict[tuple[str, str], list[Run]], bound: compute_bound.ComputeBound
):
    fig, (ax,) = new_figure(width=10.0, height=4.5)
    width = 0.8 / len(SYSTEMS)
    for k, system in enumerate(SYSTEMS):
        xs, ys = [], []
        for j, w in enumerate(plans):
            if (w.name, system) in runs:
                xs.append(j + (k - (len(SYSTEMS) - 1) / 2) * width)
                ys.append((w.prompt_tokens + w.output_tokens) / median_wall(runs[w.name, system]))
        ax.bar(xs, ys, width, label=system)
    ax.axhline(bound.tokens_per_s, color="black", linestyle="--", label="compute bound")
    ax.set_xticks(range(len(plans)), [w.name for w in plans])
    ax.set_ylabel("processed (prompt + output) tok/s")
    ax.set_title("Offline throughput (higher is better)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
