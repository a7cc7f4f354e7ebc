"""The offline suite's two serving ratios alone, round after round: served (router + worker) against the
same engine in-process on the mixed workload, or two hand-started workers against one.

    python -m benchmarks.served_rounds [--compare served|shared] [--rounds 6] [--model PATH]
                                       [--max-num-seqs 32] [--requests 32] [--dtype bfloat16]

served: one router + paged worker and one in-process paged engine, built as the offline suite builds
them (`--max-num-seqs 32`, `--max-num-batched-tokens 2048`), run the mixed draw alternately (which goes
first alternates), each round's prompts shifted (`shifted_prompts`); prints each round's walls and
in-process wall / served wall, and where the CPU went (each process's CPU-s and ms a token: the
streaming client, the router, the worker, and this process's threads during the in-process run; the
busiest threads of each: a worker's step thread, its C pool thread, torch's OpenMP helper, its event
loop), then the median. `--max-num-seqs` and `--requests` (the mixed draw's
first N) check the ratio where each step carries fewer sequences: issue 25 asks it to hold at 1 and 32
(at 1, a run of the whole draw takes over a minute a side; `--requests 8` keeps it to about 20 s).
`--requests` applies to shared too. shared: the suite's `shared_machine` (a router and 1, then 2, hand-started
workers, no thread flags) once per round; prints two workers' tok/s over one's. More rounds than the
suite's 3 when a ratio sits near its line (docs/performance.md, "The headline"). `--dtype` (shared only):
every worker's weights (the suite runs the default, float32).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks import workloads
from benchmarks.suites.offline import MAX_NUM_SEQS, served_against_in_process, shared_machine, shared_ratio
from kvpact.shared.spec import DTYPES
from kvpact.worker.loader.load import default_model_path, read_model_config

MAX_MODEL_LEN, SEED = 1472, 1234
THREADS_SHOWN = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=("served", "shared"), default="served")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="both engines' (served only)")
    parser.add_argument("--requests", type=int, default=32, help="the mixed draw's first N")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="every worker's --dtype (shared only)"
    )
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    config = read_model_config(model)
    max_model_len = min(MAX_MODEL_LEN, config.max_position_embeddings)  # a test's tiny model has fewer
    items = workloads.fit(workloads.mixed(32, SEED, config.vocab_size), max_model_len)[: args.requests]
    if args.compare == "shared":
        for r in range(args.rounds):
            runs = shared_machine(
                model, items, max_model_len, quick=False, worker_args=("--dtype", args.dtype)
            )
            print(f"round {r}: one worker {runs[1][0].wall_s:.1f} s, two {runs[2][0].wall_s:.1f} s, "
                  f"two / one tok/s {shared_ratio(runs):.2f}", flush=True)  # fmt: skip
        return 0
    rounds = served_against_in_process(model, items, max_model_len, args.max_num_seqs, args.rounds)
    num_tokens = sum(item.max_tokens for item in items)
    for r, got in enumerate(rounds):
        print(f"round {r}: served {got.served_s:.3g} s, in-process {got.in_process_s:.3g} s, "
              f"served / in-process tok/s {got.in_process_s / got.served_s:.2f}")  # fmt: skip
        served = {"client": [got.client_cpu_s], **got.served_threads_cpu_s}
        for name, threads in [*served.items(), ("in-process", got.in_process_threads_cpu_s)]:
            busy = ", ".join(f"{cpu:.2f}" for cpu in threads[:THREADS_SHOWN] if cpu >= 0.01)
            print(f"  {name}: {sum(threads):.2f} CPU-s, {1000 * sum(threads) / num_tokens:.2f} ms a token "
                  f"(busiest threads: {busy})")  # fmt: skip
    ratios = [got.in_process_s / got.served_s for got in rounds]
    print(f"served / in-process, median of {len(ratios)} rounds: {statistics.median(ratios):.2f} "
          f"(--max-num-seqs {args.max_num_seqs}, {len(items)} requests, {num_tokens} tokens)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
