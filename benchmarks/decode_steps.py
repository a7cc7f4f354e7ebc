"""The median decode step at each batch size, in-process: where the C kernels' limit shows as a step.

    python -m benchmarks.decode_steps [--sizes 1,8,16,32] [--tokens 24] [--model PATH] [--cache paged|eager]
                                      [--pa-cache-dtype auto|float32|bfloat16] [--dtype auto|bfloat16]
                                      [--cpu-kernels auto|on|off]

One engine built as the offline suite builds it (benchmarks/kvpact_systems.py `open_engine`, paged unless
--cache eager, --max-num-seqs 32 or the largest size, --max-model-len 512); for each size N, N requests
of a 4-token prompt and `--tokens` new tokens at once, and every model run with N sequences decoding
timed on the step thread (benchmarks/step_trace.py's tracer), with the step thread's time outside the
run between two such steps (scheduling, commits, handing tokens over). Beside a busy process
(`python3 -c "while True: pass" &`) it shows what a shared core costs a step (docs/performance.md,
"Batches of up to 64 rows").
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from pathlib import Path

from benchmarks.kvpact_systems import greedy_request, open_engine
from benchmarks.step_trace import traced
from kvpact.shared.features import FeatureMode
from kvpact.shared.intent import CacheDtype
from kvpact.shared.spec import DTYPES
from kvpact.worker.engine.engine import Engine
from kvpact.worker.kv.eager import EagerCache
from kvpact.worker.kv.paged import PagedCache
from kvpact.worker.loader.load import default_model_path

MAX_MODEL_LEN = 512
# A batch whose requests reached the step thread too far apart for a step with all of them decoding (a
# loaded machine, a tiny model's few tokens) is run again, at most this many times in all.
ATTEMPTS = 3


async def _batch(engine: Engine, size: int, tokens: int) -> None:
    async def one(i: int) -> None:
        request = greedy_request(f"d{size}-{i}-{time.monotonic_ns()}", (1, 2, 3, 4 + i), tokens)
        async for _ in engine.generate(request):
            pass

    await asyncio.gather(*(one(i) for i in range(size)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,8,16,32", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per request")
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--cache", choices=("paged", "eager"), default="paged")
    parser.add_argument("--pa-cache-dtype", choices=[d.value for d in CacheDtype], default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="the model's, as the worker flag")
    parser.add_argument("--cpu-kernels", choices=[m.value for m in FeatureMode], default="auto")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with open_engine(
        model,
        args.cache,
        MAX_MODEL_LEN,
        max(32, *sizes),
        0,
        cache_dtype=CacheDtype(args.pa_cache_dtype),
        dtype=args.dtype,
        cpu_kernels=FeatureMode(args.cpu_kernels),
    ) as engine:
        asyncio.run(_batch(engine, 2, 8))  # warm-up
        cache = engine.step_loop.runner.cache
        assert isinstance(cache, PagedCache | EagerCache)  # the CPU caches: the C kernels or not
        dtype = str(cache.key[0].dtype).removeprefix("torch.")
        print(f"{cache.kind.value} cache of {dtype}, C kernels {'on' if cache.cpu_kernels else 'off'}")
        steps = traced(engine)
        print("| sequences | decode steps | median ms | min ms | outside the run, median ms |")
        print("|---:|---:|---:|---:|---:|")
        for size in sizes:
            for _ in range(ATTEMPTS):
                steps.clear()
                asyncio.run(_batch(engine, size, args.tokens))
                decoding = [s.prompt_tokens == 0 and s.decodes == size for s in steps]
                if any(decoding):
                    break
            ms = [1000 * (s.ended - s.began) for s, d in zip(steps, decoding, strict=True) if d]
            if not ms:  # every attempt's requests reached the step thread too far apart to decode together
                print(f"| {size} | 0 | - | - | - |", flush=True)
                continue
            gaps = [
                1000 * (b.began - a.ended)
                for i, (a, b) in enumerate(itertools.pairwise(steps))
                if decoding[i] and decoding[i + 1]
            ]
            outside = f"{statistics.median(gaps):.2f}" if gaps else "-"
            print(
                f"| {size} | {len(ms)} | {statistics.median(ms):.3g} | {min(ms):.3g} | {outside} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
