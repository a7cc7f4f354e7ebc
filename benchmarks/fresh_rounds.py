"""A fresh engine's first rounds, paged against eager, in-process: what a worker's first requests pay.

    python -m benchmarks.fresh_rounds [--workload long_prompt|mixed] [--rounds 3] [--model PATH]

Both engines are built as the offline suite builds its in-process ones (benchmarks/kvpact_systems.py
`open_engine`: --max-num-seqs 32, --max-model-len 1472, --max-num-batched-tokens 2048, a small warm-up),
then run the workload round after round, alternating which engine goes first, each round's prompts
shifted so the prefix cache never serves one round from another. Round 0 is what a fresh worker's first
requests see (docs/performance.md, "A cold KV pool"); later rounds are the warm engine.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import workloads
from benchmarks.kvpact_systems import open_engine, run_engine
from kvpact.worker.loader.load import default_model_path, read_model_config

CACHES = ("paged", "eager")
MAX_MODEL_LEN, MAX_NUM_SEQS, BUDGET = 1472, 32, 2048
DRAWS = {"long_prompt": (workloads.long_prompt, 4), "mixed": (workloads.mixed, 32)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(DRAWS), default="long_prompt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    config = read_model_config(model)
    draw, n = DRAWS[args.workload]
    items = workloads.fit(draw(n, 1234, config.vocab_size), MAX_MODEL_LEN)
    engines = {c: open_engine(model, c, MAX_MODEL_LEN, MAX_NUM_SEQS, BUDGET) for c in CACHES}
    try:
        print(f"{args.workload}: {workloads.summary(items)}")
        print("| round | " + " | ".join(f"{c} wall s" for c in CACHES) + " | paged / eager tok/s |")
        print("|---|" + "---:|" * (len(CACHES) + 1))
        for r in range(args.rounds):
            shifted = [
                replace(i, prompt=tuple((t + 7 * r + 1) % config.vocab_size for t in i.prompt)) for i in items
            ]
            walls = {}
            for cache in CACHES if r % 2 == 0 else reversed(CACHES):
                started = time.perf_counter()
                run_engine(engines[cache], shifted)
                walls[cache] = time.perf_counter() - started
            cells = " | ".join(f"{walls[c]:.1f}" for c in CACHES)
            print(f"| {r} | {cells} | {walls['eager'] / walls['paged']:.2f} |")
    finally:
        for engine in engines.values():
            engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
