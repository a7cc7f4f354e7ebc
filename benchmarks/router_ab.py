"""The router suite's three router loads alone, one JSON line each: for an A/B of this tree's router
against another commit's on the same host, run in turn (docs/performance.md, "One call per worker").

    python -m benchmarks.router_ab [--loads token,steps,latency] [--seconds 4] [--streams 256]

    token    256 streams at full speed, one message per token (the synthetic worker's per-token load)
    steps    256 streams of a worker that steps every 10 ms (its engine-steps load)
    latency  64 streams x 50 tokens/s, 100 tokens each, staggered: each token's added latency through
             the router (its p99 minus the direct path's)

Another commit's tree, from this checkout's root (it needs no install: tools/link_tree.py spells out
the package mapping, and this script, run by its path, takes that tree's benchmarks/ and kvpact):

    git worktree add /tmp/before REV && .venv/bin/python /tmp/before/tools/link_tree.py /tmp/before-tree
    HERE=$PWD; (cd /tmp/before && PYTHONPATH=/tmp/before-tree:/tmp/before $HERE/.venv/bin/python \\
        $HERE/benchmarks/router_ab.py)
    python -m benchmarks.router_ab    # this tree; alternate the two, a round at a time

Each load starts its own router and synthetic worker (benchmarks/router_tier.py) and two client processes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.router_tier import run_load, synthetic_tier

LOADS = ("token", "steps", "latency")
STEP_MS = 10.0
LATENCY_RATE, LATENCY_TOKENS = 50.0, 100


def measure(
    load: str, seconds: float, streams: int, log_dir: Path, step_ms: float = STEP_MS, event_loop: str = ""
) -> dict[str, object]:
    if load == "latency":
        life = LATENCY_TOKENS / LATENCY_RATE
        p99 = {}
        with synthetic_tier(log_dir, tokens_per_s=LATENCY_RATE, event_loop=event_loop) as tier:
            paths = {"direct": (tier.worker_addresses[0], "worker"), "router": (tier.router_target, "router")}
            for path, (address, service) in paths.items():
                r = run_load(address, service, log_dir, streams=64, tokens_per_s=LATENCY_RATE,
                             max_tokens=LATENCY_TOKENS, seconds=seconds, latency=True, stagger=life,
                             warmup=1.0 + life)  # fmt: skip
                p99[path] = r.latency_p99_ms
        return {"load": load, "direct_p99_ms": round(p99["direct"], 3),
                "router_p99_ms": round(p99["router"], 3),
                "added_p99_ms": round(p99["router"] - p99["direct"], 3)}  # fmt: skip
    with synthetic_tier(log_dir, step_ms=step_ms if load == "steps" else 0.0, event_loop=event_loop) as tier:
        watch = {"router-0": tier.pids["router-0"], "worker-0": tier.pids["worker-0"]}
        r = run_load(tier.router_target, "router", log_dir, streams=streams, seconds=seconds, warmup=1.0,
                     num_clients=2, watch=watch)  # fmt: skip
    return {"load": load, "tokens_per_s": round(r.tokens_per_s),
            "messages_per_token": round(r.messages_per_token, 3),
            "tokens_per_router_cpu_s": round(r.tokens_per_cpu_s("router-0")),
            "tokens_per_worker_cpu_s": round(r.tokens_per_cpu_s("worker-0"))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of {','.join(LOADS)}")
    parser.add_argument("--seconds", type=float, default=4.0, help="the counted window of each load")
    parser.add_argument("--streams", type=int, default=256, help="streams of the token and steps loads")
    parser.add_argument("--step-ms", type=float, default=STEP_MS, help="the steps load's step period")
    parser.add_argument("--event-loop", default="", help="the router's --event-loop (default: its own)")
    args = parser.parse_args(argv)
    loads = [name for name in args.loads.split(",") if name]
    if unknown := [name for name in loads if name not in LOADS]:
        parser.error(f"--loads: unknown {', '.join(unknown)} (of {', '.join(LOADS)})")
    with tempfile.TemporaryDirectory(prefix="router-ab-") as log_dir:
        for load in loads:
            print(
                json.dumps(
                    measure(load, args.seconds, args.streams, Path(log_dir), args.step_ms, args.event_loop)
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
