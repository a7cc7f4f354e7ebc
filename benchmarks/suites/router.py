"""The router suite: what the router adds to a stream, what one router process relays, what a tier of
several relays, and whether a real model loses anything behind it.

Every figure compares paths measured in the same run, interleaved: the same client processes
(benchmarks/stream_load.py, each its own process, so the client is not one event loop shared with
what it measures) stream from a model-free synthetic worker (benchmarks/synthetic_worker.py) either
directly (kvpact.v1.Worker/Generate) or through the router (kvpact.v1.Generation/Generate).

(a) added latency: 64 streams of 50 tokens/s, 100 tokens each; each token's delivery latency is its
    arrival at the client minus the send time the worker wrote into it; "added" is the router path's
    percentile minus the direct path's. The judged load is steady: the 64 streams start spread over one
    stream's life (2 s), so each ends and reopens at its own phase, as independent clients do, and the
    count starts once all run. The rows "..., lockstep" start all 64 within 20 ms, so every 2 s all 64
    end and 64 new requests arrive at once: the reopen burst, reported, not judged (opening a stream
    costs the router's loop ~1.2-1.5 ms, so the last of 64 opened waits ~80-100 ms).
(b) capacity, two loads. Per token: 64 and 256 streams at full speed, the worker writing one message
    per token as fast as it can (it never has two tokens ready, so nothing merges: 1 message per
    token). Engine steps (the rows "..., engine steps"): 256 streams from a worker that steps like a
    real one, one token for every running stream every STEP_MS = 10 ms (256 x 100 tokens/s offered, about
    what the full-speed load reaches directly), each stream sent through the real worker's
    merge-when-behind (kvpact.worker.engine.ready_pieces): when a stream's writes fall behind (the
    worker's loop is busy, or the router reads slower than the worker writes, so HTTP/2 flow control
    holds the writes) the tokens that piled up go as one message; "messages per token" says how much
    merged. Tokens/s are wall-clock; on a machine where the client, the worker and the router share
    the cores, the router's own capacity is its tokens per CPU-second (its CPU time over the counted
    window, read from /proc): what one router process relays with a core to itself. The router on its
    default event loop (uvloop) is measured beside the standard one (`router --event-loop asyncio`).
(c) a real model (ctx.model, one real worker): output tokens/s through the router vs directly.
(d) scale-out: two router processes, each with its own worker, the client's streams spread over both
    (gRPC round_robin over the routers' addresses): aggregate tokens/s and tokens per CPU-second.
(e) the OpenAI-compatible HTTP front (`router --http-listen`): the same load as SSE streams of
    POST /v1/completions from the same router process, beside gRPC in the same run: added latency at
    64 x 50 tokens/s and tokens per router CPU-second at 64 and 256 streams. HTTP turns each chunk into
    a JSON event, so it cannot relay bytes as gRPC does; its chunk merging is the same.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from benchmarks.framework import BenchContext, SuiteResult, Table, Target, new_figure
from benchmarks.router_tier import LoadResult, model_tier, percentile, run_load, synthetic_tier
from kvpact.shared.event_loop import DEFAULT_EVENT_LOOP

NAME = "router"
TARGET_CAPACITY = 40_000.0  # streamed tokens/s through one router process at 256 streams
STEP_MS = 10.0  # the engine-steps load: a token for every running stream every 10 ms
STEPS = "engine steps"
TARGET_ADDED_P99_MS = 1.0
TARGET_HTTP_ADDED_P99_MS = 2.0
TARGET_HTTP_RATIO = 0.7  # HTTP tokens per router CPU-s over gRPC's, same run
HTTP = "router, HTTP"
NOISE_FLOOR_P99_MS = 5.0  # a direct p99 above this: the machine's noise hides a 1 ms difference
REAL_MODEL_TOLERANCE = 0.95  # router/direct on a real model: >= this is "no loss" (run-to-run noise)
LATENCY_TOKENS, LATENCY_RATE = 100, 50.0  # per stream: a stream lives 2 s
LOCKSTEP = ", lockstep"  # the reopen-burst rows' suffix
LATENCY_ROWS = {
    "direct": "direct to the worker",
    "router": "through the router",
    "http": "through the router, HTTP/SSE",
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _plan(quick: bool) -> dict[str, Any]:
    if quick:
        return {"latency_s": 1.5, "capacity_s": 1.0, "rounds": 1, "warmup": 0.3, "model_rounds": 1,
                "asyncio_streams": (256,),
                "model_streams": 4, "model_tokens": 8, "model_requests": 4}  # fmt: skip
    return {"latency_s": 6.0, "capacity_s": 4.0, "rounds": 2, "warmup": 1.0, "model_rounds": 2,
            "asyncio_streams": (64, 256),
            "model_streams": 8, "model_tokens": 16, "model_requests": 8}  # fmt: skip


def run(ctx: BenchContext) -> SuiteResult:
    plan = _plan(ctx.quick)
    command = f"python -m benchmarks.run --suites {NAME}" + (" --quick" if ctx.quick else "")
    log_dir = Path(tempfile.mkdtemp(prefix="kvpact-bench-router-"))
    latency = _added_latency(log_dir, plan)
    capacity = _capacity(log_dir, plan)
    scale = _scale_out(log_dir, plan, capacity["by"][(256, "router")])
    model = _real_model(log_dir, ctx.model, plan)

    direct_l, routed_l = latency["direct"], latency["router"]
    added_p50 = routed_l.latency_p50_ms - direct_l.latency_p50_ms
    added_p99 = routed_l.latency_p99_ms - direct_l.latency_p99_ms
    http_l = latency["http"]
    http_added_p50 = http_l.latency_p50_ms - direct_l.latency_p50_ms
    http_added_p99 = http_l.latency_p99_ms - direct_l.latency_p99_ms
    noisy = not direct_l.latency_p99_ms <= NOISE_FLOOR_P99_MS

    def lockstep(path: str) -> float:  # added p99 under the reopen burst (reported, not judged)
        return latency[path + LOCKSTEP].latency_p99_ms - latency["direct" + LOCKSTEP].latency_p99_ms

    tables = [
        Table(
            "Router: added latency per token, 64 streams x 50 tokens/s",
            ["path", "tokens", "p50 ms", "p99 ms", "first token p50 ms", "added p50 ms", "added p99 ms"],
            [
                [
                    label + suffix,
                    latency[path + suffix].num_tokens,
                    latency[path + suffix].latency_p50_ms,
                    latency[path + suffix].latency_p99_ms,
                    latency[path + suffix].first_token_p50_ms,
                    latency[path + suffix].latency_p50_ms - latency["direct" + suffix].latency_p50_ms,
                    latency[path + suffix].latency_p99_ms - latency["direct" + suffix].latency_p99_ms,
                ]
                for suffix in ("", LOCKSTEP)
                for path, label in LATENCY_ROWS.items()
            ],  # fmt: skip
            command,
            [
                "latency = arrival at the client - the worker's send time (one monotonic clock on one host)",
                "judged: the steady load (the 64 streams started over one stream's 2 s life, each reopening"
                " at its own phase); lockstep: all 64 started together, so they end and reopen together"
                " every 2 s (the reopen burst, not judged)",
            ],
        ),
        Table(
            "Router: capacity, 64 and 256 streams (per token at full speed; or engine steps)",
            [
                "streams",
                "path",
                "tokens/s",
                "messages per token",
                "tokens per router CPU-s",
                "tokens per worker CPU-s",
            ],
            capacity["rows"],  # fmt: skip
            command,
            [
                "tokens per CPU-s: tokens relayed over the process's CPU seconds in the counted window, the "
                "rate one process sustains with a core to itself",
                "the client, the worker and the router share this machine's cores: wall tokens/s of the "
                "router path are bounded by all three",
                f"per token: one message per token, as fast as the worker writes; {STEPS}: a token for "
                f"every stream every {STEP_MS:g} ms, merged by the worker when a stream's writes fall "
                "behind (messages per token < 1)",
            ],
        ),
        Table(
            "Router: scale-out (256 full-speed streams)",
            ["tier", "tokens/s", "tokens per router CPU-s (sum over routers)"],
            scale["rows"],
            command,
            [
                "the client spreads its streams over the routers with gRPC round_robin; each router has its "
                "own worker (docs/performance.md, Router: running the router tier on several cores)"
            ],
        ),
        Table(
            f"Router: a real model ({ctx.model.name}), output tokens/s",
            ["path", "output tokens/s", "ratio to direct"],
            model["rows"],
            command,
            [
                f"{model['requests']} requests of {model['max_tokens']} tokens, {model['streams']} at a "
                "time, greedy, ignore_eos; the whole batch timed, best of the interleaved rounds"
            ],
        ),
    ]
    cap256, direct256 = capacity["by"][(256, "router")], capacity["by"][(256, "direct")]
    steps256, steps_direct = (
        capacity["by"][(256, f"router, {STEPS}")],
        capacity["by"][(256, f"direct, {STEPS}")],
    )
    http_ratios = {
        streams: capacity["by"][(streams, HTTP)].tokens_per_cpu_s("router-0")
        / max(capacity["by"][(streams, "router")].tokens_per_cpu_s("router-0"), 1e-9)
        for streams in (64, 256)
    }
    targets = [
        Target(
            "router capacity, 256 streams",
            f">= {TARGET_CAPACITY:,.0f} streamed tokens/s through one router process",
            f"{cap256.tokens_per_cpu_s('router-0'):,.0f} tokens per router CPU-s "
            f"({cap256.tokens_per_s:,.0f} tokens/s wall; direct {direct256.tokens_per_s:,.0f})",
            cap256.tokens_per_cpu_s("router-0") >= TARGET_CAPACITY,
            "per CPU-s: the client and the worker share the cores; one message per token (the worker never "
            "has two ready); see the profile in docs/performance.md",
        ),
        Target(
            f"router capacity, 256 streams, {STEPS}",
            f">= {TARGET_CAPACITY:,.0f} streamed tokens/s through one router process",
            f"{steps256.tokens_per_cpu_s('router-0'):,.0f} tokens per router CPU-s at "
            f"{steps256.messages_per_token:.2f} messages per token ({steps256.tokens_per_s:,.0f} tokens/s "
            f"wall; direct {steps_direct.tokens_per_s:,.0f} at {steps_direct.messages_per_token:.2f})",
            steps256.tokens_per_cpu_s("router-0") >= TARGET_CAPACITY,
            f"a worker stepping like a real one: a token for every stream every {STEP_MS:g} ms, the ones "
            "ready together sent as one message when its writes fall behind (the real worker's merging)",
        ),
        Target(
            "added p99 latency, 64 x 50 tokens/s",
            f"< {TARGET_ADDED_P99_MS:g} ms",
            f"{added_p99:.2f} ms (p50 {added_p50:.2f} ms; direct p99 {direct_l.latency_p99_ms:.2f} ms; "
            f"steady load; lockstep reopening: {lockstep('router'):.2f} ms)",
            None if noisy else added_p99 < TARGET_ADDED_P99_MS,
            f"not judged: the direct path's own p99 ({direct_l.latency_p99_ms:.1f} ms) is over "
            f"{NOISE_FLOOR_P99_MS:g} ms, this machine's scheduling noise, far more than the 1 ms the target "
            "resolves; rerun on a quiet machine"
            if noisy
            else "",
        ),
        Target(
            "HTTP vs gRPC, tokens per router CPU-s",
            f">= {TARGET_HTTP_RATIO:g}x gRPC at 64 and 256 streams",
            ", ".join(f"{s} streams {r:.2f}x" for s, r in http_ratios.items()),
            min(http_ratios.values()) >= TARGET_HTTP_RATIO,
            "the same router process serves both fronts; HTTP turns each chunk into a JSON SSE event",
        ),
        Target(
            "HTTP added p99 latency, 64 x 50 tokens/s",
            f"< {TARGET_HTTP_ADDED_P99_MS:g} ms",
            f"{http_added_p99:.2f} ms (p50 {http_added_p50:.2f} ms; steady load; lockstep reopening: "
            f"{lockstep('http'):.2f} ms)",
            None if noisy else http_added_p99 < TARGET_HTTP_ADDED_P99_MS,
            f"not judged: the direct path's own p99 ({direct_l.latency_p99_ms:.1f} ms) is over "
            f"{NOISE_FLOOR_P99_MS:g} ms (this machine's scheduling noise); rerun on a quiet machine"
            if noisy
            else "",
        ),
        Target(
            "real model: router vs direct",
            "no throughput loss",
            f"{model['ratio']:.2f}x direct",
            model["ratio"] >= REAL_MODEL_TOLERANCE,
            f">= {REAL_MODEL_TOLERANCE} counts as no loss (run-to-run noise)",
        ),
        Target(
            "router tier on several cores",
            "measured",
            f"2 routers: {scale['two_tokens_per_cpu_s']:,.0f} tokens per router CPU-s summed, "
            f"{scale['ratio_wall']:.2f}x one router's wall tokens/s",
            True,
        ),
    ]
    figure = _figure(capacity, latency, scale)
    data = {
        "latency": {k: v.summary() for k, v in latency.items()},
        "capacity": {f"{s}/{p}": r.summary() for (s, p), r in capacity["by"].items()},
        "scale_out": {k: v.summary() for k, v in scale["by"].items()},
        "real_model": {k: v.summary() for k, v in model["by"].items()},
        "added_latency_ms": {"p50": added_p50, "p99": added_p99},
        "http_added_latency_ms": {"p50": http_added_p50, "p99": http_added_p99},
        "http_over_grpc_tokens_per_cpu_s": {str(k): v for k, v in http_ratios.items()},
    }
    return SuiteResult(NAME, tables, targets, data, figure, notes=[__doc__.split("\n\n")[1]])


def _interleaved(rounds: int, runs: dict[str, Any]) -> dict[str, LoadResult]:
    """Run each of `runs` (name -> no-argument measurement) once per round, in turn; keep the best."""
    best: dict[str, LoadResult] = {}
    for _ in range(rounds):
        for name, measure in runs.items():
            result = measure()
            if name not in best or result.tokens_per_s > best[name].tokens_per_s:
                best[name] = result
    return best


def _added_latency(log_dir: Path, plan: dict[str, Any]) -> dict[str, LoadResult]:
    """{path: pooled result} for direct, router, http (steady: staggered over a stream's life) and the
    same three + LOCKSTEP (all started together)."""
    life = LATENCY_TOKENS / LATENCY_RATE
    loads = {"": {"stagger": life, "warmup": plan["warmup"] + life}, LOCKSTEP: {"warmup": plan["warmup"]}}
    with synthetic_tier(log_dir / "latency", tokens_per_s=50, http=True) as tier:
        paths = {"direct": (tier.worker_addresses[0], "worker"), "router": (tier.router_target, "router"),
                 "http": (tier.http_addresses[0], "http")}  # fmt: skip
        results: dict[str, list[LoadResult]] = {p + s: [] for s in loads for p in paths}
        for _ in range(plan["rounds"]):
            for suffix, load in loads.items():
                for path, (address, service) in paths.items():
                    result = run_load(
                        address, service, log_dir, streams=64, tokens_per_s=LATENCY_RATE,
                        max_tokens=LATENCY_TOKENS, seconds=plan["latency_s"], latency=True, **load,
                    )  # fmt: skip
                    results[path + suffix].append(result)
    return {path: _pooled(runs) for path, runs in results.items()}


def _pooled(runs: list[LoadResult]) -> LoadResult:
    """One result over several runs: tokens summed, percentiles over every token."""
    latencies = [x for r in runs for x in r.latencies_ms]
    return LoadResult(
        num_tokens=sum(r.num_tokens for r in runs),
        num_messages=sum(r.num_messages for r in runs),
        seconds=sum(r.seconds for r in runs),
        latency_p50_ms=percentile(latencies, 50),
        latency_p99_ms=percentile(latencies, 99),
        first_token_p50_ms=percentile([r.first_token_p50_ms for r in runs], 50),
        cpu_s={},
        latencies_ms=latencies,
    )


def _capacity(log_dir: Path, plan: dict[str, Any]) -> dict[str, Any]:
    by: dict[tuple[int, str], LoadResult] = {}
    rows: list[list[Any]] = []
    # the router's default loop (shared/event_loop.py) with the direct and HTTP paths; asyncio beside it
    loops = [
        (DEFAULT_EVENT_LOOP, "router", (64, 256)),
        ("asyncio", "router, asyncio", plan["asyncio_streams"]),
    ]
    for loop, label, counts in loops:
        default = loop == DEFAULT_EVENT_LOOP
        with synthetic_tier(log_dir / f"capacity-{loop}", event_loop=loop, http=default) as tier:
            watch = {"router-0": tier.pids["router-0"], "worker-0": tier.pids["worker-0"]}
            for streams in counts:
                kwargs = {"streams": streams, "seconds": plan["capacity_s"], "warmup": plan["warmup"],
                          "num_clients": 2, "watch": watch}  # fmt: skip
                runs = {label: lambda kw=kwargs, t=tier: run_load(t.router_target, "router", log_dir, **kw)}
                if default:
                    runs = {
                        "direct": lambda kw=kwargs, t=tier: run_load(
                            t.worker_addresses[0], "worker", log_dir, **kw
                        ),
                        **runs,
                        HTTP: lambda kw=kwargs, t=tier: run_load(t.http_addresses[0], "http", log_dir, **kw),
                    }
                for path, result in _interleaved(plan["rounds"], runs).items():
                    by[(streams, path)] = result
    with synthetic_tier(log_dir / "capacity-steps", step_ms=STEP_MS) as tier:
        watch = {"router-0": tier.pids["router-0"], "worker-0": tier.pids["worker-0"]}
        kwargs = {"streams": 256, "seconds": plan["capacity_s"], "warmup": plan["warmup"], "num_clients": 2,
                  "watch": watch}  # fmt: skip
        runs = {
            f"direct, {STEPS}": lambda kw=kwargs, t=tier: run_load(
                t.worker_addresses[0], "worker", log_dir, **kw
            ),
            f"router, {STEPS}": lambda kw=kwargs, t=tier: run_load(t.router_target, "router", log_dir, **kw),
        }
        for path, result in _interleaved(plan["rounds"], runs).items():
            by[(256, path)] = result
    for (streams, path), r in sorted(by.items()):
        routed = not path.startswith("direct")
        rows.append([
            streams, path, r.tokens_per_s, r.messages_per_token,
            r.tokens_per_cpu_s("router-0") if routed else float("nan"), r.tokens_per_cpu_s("worker-0"),
        ])  # fmt: skip
    return {"by": by, "rows": rows}


def _router_tokens_per_cpu_s(result: LoadResult) -> float:
    cpu = sum(seconds for name, seconds in result.cpu_s.items() if name.startswith("router-"))
    return result.num_tokens / cpu if cpu > 0 else float("nan")


def _scale_out(log_dir: Path, plan: dict[str, Any], one_router: LoadResult) -> dict[str, Any]:
    """Two routers, each with its own worker, 256 streams spread over both; against `one_router`, the
    capacity run at 256 streams (same clients, same window)."""
    with synthetic_tier(log_dir / "scale-2", num_routers=2) as tier:
        watch = {name: pid for name, pid in tier.pids.items() if name.startswith("router-")}
        two = run_load(
            tier.router_target, "router", log_dir, streams=256, seconds=plan["capacity_s"],
            warmup=plan["warmup"], num_clients=2, watch=watch,
        )  # fmt: skip
    by = {"1 router": one_router, "2 routers": two}
    rows = [[name, r.tokens_per_s, _router_tokens_per_cpu_s(r)] for name, r in by.items()]
    return {
        "by": by,
        "rows": rows,
        "ratio_wall": two.tokens_per_s / max(one_router.tokens_per_s, 1e-9),
        "two_tokens_per_cpu_s": _router_tokens_per_cpu_s(two),
    }


def _real_model(log_dir: Path, model: Path, plan: dict[str, Any]) -> dict[str, Any]:
    streams, max_tokens, requests = plan["model_streams"], plan["model_tokens"], plan["model_requests"]
    with model_tier(log_dir / "model", model) as tier:
        # A fixed amount of work each time: `requests` requests, `streams` at a time, timed whole.
        kwargs = {"streams": streams, "max_tokens": max_tokens, "prompt_text": PROMPT, "requests": requests,
                  "seconds": 0.0, "warmup": 0.0}  # fmt: skip
        direct = lambda: run_load(tier.worker_addresses[0], "worker", log_dir, **kwargs)  # noqa: E731
        direct()  # the worker's first requests are slower (warm-up): not counted
        by = _interleaved(
            plan["model_rounds"],
            {"direct": direct, "router": lambda: run_load(tier.router_target, "router", log_dir, **kwargs)},
        )
    ratio = by["router"].tokens_per_s / max(by["direct"].tokens_per_s, 1e-9)
    rows = [
        ["direct to the worker", by["direct"].tokens_per_s, 1.0],
        ["through the router", by["router"].tokens_per_s, ratio],
    ]
    return {"by": by, "rows": rows, "ratio": ratio, "streams": streams, "max_tokens": max_tokens,
            "requests": requests}  # fmt: skip


def _figure(capacity: dict[str, Any], latency: dict[str, LoadResult], scale: dict[str, Any]) -> Any:
    fig, (ax_cap, ax_lat) = new_figure(ncols=2)
    by = capacity["by"]
    labels, wall, per_cpu = [], [], []
    for (streams, path), r in sorted(by.items()):
        labels.append(f"{path}\n{streams} streams")
        wall.append(r.tokens_per_s)
        per_cpu.append(r.tokens_per_cpu_s("router-0") if not path.startswith("direct") else 0.0)
    for name, r in scale["by"].items():
        labels.append(f"{name}\n256 streams")
        wall.append(r.tokens_per_s)
        per_cpu.append(_router_tokens_per_cpu_s(r))
    xs = range(len(labels))
    ax_cap.bar([x - 0.2 for x in xs], wall, width=0.4, label="tokens/s (wall)")
    ax_cap.bar([x + 0.2 for x in xs], per_cpu, width=0.4, label="tokens per router CPU-s")
    ax_cap.axhline(TARGET_CAPACITY, color="red", linestyle="--", linewidth=1, label="target")
    ax_cap.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax_cap.set_ylabel("streamed tokens / s")
    ax_cap.set_title("Router capacity (full-speed streams)")
    ax_cap.legend(fontsize=7)
    for path, r in latency.items():
        values = sorted(r.latencies_ms)
        if values:
            ax_lat.plot(values, [i / len(values) for i in range(len(values))], label=path)
    ax_lat.set_xscale("log")
    ax_lat.set_xlabel("per-token delivery latency, ms (log)")
    ax_lat.set_ylabel("fraction of tokens")
    ax_lat.set_title("64 streams x 50 tokens/s")
    ax_lat.legend(fontsize=7)
    return fig
