"""What a pre-load plan costs in reading the model (`worker --plan-only`, and every worker's start): the
model's header read once (worker/loader/header.py) against the three reads the plan made before (its
config, its weight estimate, its fingerprint: each parsed a GGUF header), and the whole plan
(`plan_only.make_plan`) at --tensor-parallel-size 1 and N.

    python benchmarks/plan_time.py                         # the default model (SmolLM2 GGUF), TP 1 and 3
    python benchmarks/plan_time.py --model DIR --sizes 1 2 --repeat 5

`--cold` points the GGUF conversion cache at an empty directory (a machine that never loaded the model:
the config is then read from the GGUF header too). Each figure is the median of --repeat runs after one
warm-up. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_seconds(run: Callable[[], object], repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="", help="a Hugging Face directory or GGUF file (default: SmolLM2)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="an empty GGUF conversion cache")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpact-plan-time-") as empty:
        if args.cold:
            os.environ["KVPACT_CACHE_DIR"] = empty
        return measure(args)


def measure(args: argparse.Namespace) -> int:

    import structlog
    import torch

    from kvpact.shared.spec import WorkerSpec
    from kvpact.worker.loader import estimate_weight_bytes, read_model_config, resolve_model_path
    from kvpact.worker.loader.fingerprint import model_digests
    from kvpact.worker.loader.header import read_model_header
    from kvpact.worker.plan_only import make_plan

    path = resolve_model_path(args.model or None)

    def three_reads() -> None:  # what the plan read before the header
        read_model_config(path)
        estimate_weight_bytes(path, dtype=torch.float32)
        model_digests(path)

    rows = [
        (
            "config + weight estimate + fingerprint, read apart (before)",
            median_seconds(three_reads, args.repeat),
        ),
        ("the model's header, read once (now)", median_seconds(lambda: read_model_header(path), args.repeat)),
    ]
    quiet = structlog.ReturnLogger()
    for size in args.sizes:
        spec = replace(WorkerSpec(model=str(path), device="cpu"), tensor_parallel_size=size)
        plan = make_plan(spec, quiet)
        assert plan.exit_code == 0, plan.error  # a model whose heads do not divide by a size: choose others
        rows.append(
            (
                f"make_plan, --tensor-parallel-size {size}",
                median_seconds(functools.partial(make_plan, spec, quiet), args.repeat),
            )
        )
    cache = "an empty conversion cache" if args.cold else "the conversion cache as it is"
    print(f"{path.name}, {cache}, median of {args.repeat} runs\n")
    print("| what | seconds |\n|---|---|")
    for what, seconds in rows:
        print(f"| {what} | {seconds:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
