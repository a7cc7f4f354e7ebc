"""prefix-affinity vs least-load: two workers, a shared-prefix workload, prefix-cache hit rate and throughput.

    python -m benchmarks.prefix_routing [--model PATH] [--groups 4] [--per-group 8]
        [--prefix-words 150] [--concurrency 4] [--max-tokens 8] [--policies least-load,prefix-affinity]

For each policy, a fresh cluster of processes on loopback: a router (`--balance POLICY --expect-workers 2`)
and two workers (`--paged-attn on`: the paged cache with prefix caching; the torch backend on CPU), each
with `--metrics-port 0`; the router's ClusterStatus says where each worker's /metrics is. The workload:
GROUPS x PER_GROUP text prompts; the prompts of a group share a prefix of PREFIX_WORDS words (a long
"system prompt") and end with their own question. The requests arrive in a shuffled order (seeded; or
--order round-robin across the groups), CONCURRENCY at a time (greedy, ignore_eos, MAX_TOKENS each),
after one warm-up request per worker.
Each worker gets OMP_NUM_THREADS=THREADS_PER_WORKER (default 1: two workers on a small CPU box do
not fight over its cores).

Reported per policy: the prefix-cache hit rate (the workers' kvpact_worker_prefix_cache_hits_total over
kvpact_worker_prefix_cache_queries_total, summed over both workers, measured requests only), requests/s
and generated tokens/s over the wall time, the mean time to first token as the client sees it, and how
the requests split between the workers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpact.client import Client
from kvpact.deploy.processes import free_port, running, wait_for_health, wait_for_line

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
WORDS = (
    "river stone lantern orbit velvet harbor meadow signal copper thunder willow canyon ember glacier "
    "saffron compass prairie marble falcon beacon quartz tundra cobalt orchard monsoon granite sparrow "
    "nebula cedar lagoon"
).split()


@dataclass(slots=True)
class Result:
    policy: str
    hit_rate: float
    requests_per_s: float
    tokens_per_s: float
    mean_ttft_s: float
    split: str
    wall_s: float


def workload(groups: int, per_group: int, prefix_words: int, order: str, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prefixes = [
        f"System {g}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) for g in range(groups)
    ]
    prompts = []
    for i in range(per_group):
        for g in range(groups):
            question = " ".join(rng.choice(WORDS) for _ in range(6))
            prompts.append(f"{prefixes[g]}\nQuestion {i}: {question}?")
    if order == "shuffled":
        rng.shuffle(prompts)
    return prompts


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                found[sample.name] = sample.value
    return found


def hits_and_queries(addresses: list[str]) -> tuple[float, float]:
    scraped = [scrape(a) for a in addresses]
    hits = sum(s["kvpact_worker_prefix_cache_hits_total"] for s in scraped)
    queries = sum(s["kvpact_worker_prefix_cache_queries_total"] for s in scraped)
    return hits, queries


def one(client: Client, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    started = time.monotonic()
    first = None
    tokens = 0
    worker = ""
    for chunk in client.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        if first is None and chunk.token_ids:
            first = time.monotonic() - started
        tokens += len(chunk.token_ids)
        worker = chunk.worker_id or worker
    return first or 0.0, tokens, worker


def run_policy(policy: str, args: argparse.Namespace, prompts: list[str]) -> Result:
    python = sys.executable
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix=f"kvpact-bench-{policy}-")
    router_argv = [python, "-m", "kvpact.router", "--listen", f"127.0.0.1:{port}", "--expect-workers", "2"]
    router_argv += ["--balance", policy, "--log-format", "json", "--log-level", "WARNING"]
    address = f"127.0.0.1:{port}"
    with ExitStack() as stack:
        router = stack.enter_context(running(router_argv, name="router", log_dir=log_dir))
        wait_for_line(router, r"^router listening on ", 30)
        workers = []
        for worker_id in ("w1", "w2"):
            argv = [python, "-m", "kvpact.worker", "--router", address, "--worker-id", worker_id]
            argv += ["--paged-attn", "on", "--metrics-port", "0", "--log-format", "json"]
            argv += ["--log-level", "WARNING"] + (["--model", args.model] if args.model else [])
            env = {"OMP_NUM_THREADS": str(args.threads_per_worker)}
            workers.append(stack.enter_context(running(argv, name=worker_id, env=env, log_dir=log_dir)))
        wait_for_health(address, START_TIMEOUT_S, watch=[router, *workers])
        with Client(address, timeout=REQUEST_TIMEOUT_S) as client:
            metrics = [w.metrics_address for w in client.cluster_status().workers]
            for i in range(2):  # warm-up: each worker runs one short request (least outstanding first)
                one(client, f"Warm-up {i}: hello", args.max_tokens)
            hits0, queries0 = hits_and_queries(metrics)
            started = time.monotonic()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda p: one(client, p, args.max_tokens), prompts))
            wall = time.monotonic() - started
            hits, queries = hits_and_queries(metrics)
    split = Counter(worker for _, _, worker in results)
    return Result(
        policy=policy,
        hit_rate=(hits - hits0) / max(1.0, queries - queries0),
        requests_per_s=len(prompts) / wall,
        tokens_per_s=sum(n for _, n, _ in results) / wall,
        mean_ttft_s=statistics.fmean(t for t, _, _ in results),
        split=" / ".join(f"{w} {n}" for w, n in sorted(split.items())),
        wall_s=wall,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefix_routing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", default="", help="model for both workers (default: the bundled SmolLM2-135M)"
    )
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=150)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--policies", default="least-load,prefix-affinity")
    parser.add_argument(
        "--order",
        choices=("shuffled", "round-robin"),
        default="shuffled",
        help="arrival order of the requests (round-robin over an even number of groups lets least-load's "
        "alternation keep each group on one worker by accident)",
    )
    parser.add_argument(
        "--threads-per-worker", type=int, default=1, help="OMP_NUM_THREADS of each worker (default 1)"
    )
    args = parser.parse_args(argv)
    prompts = workload(args.groups, args.per_group, args.prefix_words, args.order)
    rows = [run_policy(policy, args, prompts) for policy in args.policies.split(",")]
    print(
        f"{len(prompts)} requests ({args.order}): {args.groups} groups x {args.per_group}, "
        f"a shared prefix of {args.prefix_words} words each, {args.concurrency} in flight, "
        f"{args.max_tokens} new tokens each"
    )
    print("| policy | prefix hit rate | req/s | gen tok/s | mean TTFT s | requests per worker | wall s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.requests_per_s:.2f} | {r.tokens_per_s:.1f} | "
            f"{r.mean_ttft_s:.2f} | {r.split} | {r.wall_s:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
