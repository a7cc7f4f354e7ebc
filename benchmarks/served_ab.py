"""Two sets of worker flags against each other, each behind its own router, rounds alternated.

    python -m benchmarks.served_ab --a "--event-loop asyncio" --b "--event-loop uvloop"
                                   [--load stream|burst] [--rounds 3] [--tokens 1500] [--model PATH]

Both clusters (a router and one paged worker each, benchmarks/kvpact_systems.py `Cluster`) start one
after the other, and each prints how long it took to be ready for its first request; then every round
runs the load on both, which goes first alternating, prompts shifted each round (`shifted_prompts`):

    stream  one request of --tokens new tokens (greedy, ignore_eos) at --max-num-seqs 1: a batch-1
            decode per token, the serving path's cost per token at its largest share. Prints the wall,
            the router's CPU per token and the worker's serving threads' (every thread of the worker
            but its two busiest, the step thread and the C pool's helper), read from /proc around it.
    burst   the offline suite's mixed draw (32 requests at once, --max-num-seqs 32) at the worker's
            default step budget. Prints the wall.

Then the median of each figure per side, and b / a. Used for the worker's event loop and its prompt
tokens beside decodes (docs/performance.md, session 31).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from pathlib import Path

from benchmarks import workloads
from benchmarks.kvpact_systems import Cluster, stream_run
from benchmarks.router_tier import cpu_seconds, thread_cpu_seconds
from benchmarks.served_rounds import SEED
from benchmarks.suites.offline import MAX_NUM_SEQS, shifted_prompts
from benchmarks.workloads import WorkItem
from kvpact.worker.loader.load import default_model_path, read_model_config

STREAM_PROMPT = tuple(range(1, 9))
COMPUTE_THREADS = 2  # a worker's two busiest threads: the step thread and the C pool's helper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="", help="side a's worker flags, one string")
    parser.add_argument("--b", default="", help="side b's worker flags, one string")
    parser.add_argument("--load", choices=("stream", "burst"), default="stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1500, help="stream: new tokens")
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    config = read_model_config(model)
    if args.load == "stream":
        max_num_seqs, items = 1, [WorkItem(STREAM_PROMPT, args.tokens)]
    else:
        max_num_seqs, items = MAX_NUM_SEQS, workloads.mixed(32, SEED, config.vocab_size)
    items = workloads.fit(items, config.max_position_embeddings)
    longest = max(len(i.prompt) + i.max_tokens for i in items)
    max_model_len = min(config.max_position_embeddings, -(-longest // 64) * 64)
    sides = {"a": shlex.split(args.a), "b": shlex.split(args.b)}
    clusters: dict[str, Cluster] = {}
    figures: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    try:
        for side, flags in sides.items():
            started = time.perf_counter()
            clusters[side] = Cluster(model, "paged", max_model_len, max_num_seqs, worker_args=tuple(flags))
            clusters[side].start().wait_ready()
            shown = getattr(args, side) or "no flags"
            print(f"{side} ({shown}): ready in {time.perf_counter() - started:.1f} s", flush=True)
        for r in range(args.rounds):
            shifted = shifted_prompts(items, r, config.vocab_size)
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                got = _run(clusters[side], shifted)
                for name, value in got.items():
                    figures[side].setdefault(name, []).append(value)
                shown = ", ".join(f"{name} {value:.3g}" for name, value in got.items())
                print(f"round {r} {side}: {shown}", flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    for name in figures["a"]:
        a, b = (statistics.median(figures[side][name]) for side in ("a", "b"))
        ratio = f"{b / a:.2f}" if a else "-"  # CPU is read in clock ticks: a short run can read 0
        print(f"median {name}: a {a:.3g}, b {b:.3g}, b / a {ratio}")
    return 0


def _run(cluster: Cluster, items: list[WorkItem]) -> dict[str, float]:
    """The load's wall (s) and, for one stream, the router's and the worker's serving threads' CPU per
    token (ms)."""
    router, worker = (handle.pid for handle in cluster.handles)
    before = thread_cpu_seconds(worker)
    router_cpu = cpu_seconds(router)
    wall = stream_run(cluster.address, items).wall_s
    router_cpu = cpu_seconds(router) - router_cpu
    after = thread_cpu_seconds(worker)
    if len(items) > 1:
        return {"wall s": wall}
    tokens = items[0].max_tokens
    threads = sorted((cpu - before.get(tid, 0.0) for tid, cpu in after.items()), reverse=True)
    return {
        "wall s": wall,
        "router ms/token": 1000 * router_cpu / tokens,
        "worker serving ms/token": 1000 * sum(threads[COMPUTE_THREADS:]) / tokens,
    }


if __name__ == "__main__":
    raise SystemExit(main())
