"""The median decode step at each batch size, in-process: where the C kernels' limit shows as a step.

    python -m benchmarks.decode_steps [--sizes 1,8,16,32] [--tokens 24] [--model PATH]
                                      [--pa-cache-dtype auto|float32|bfloat16]

One paged engine built as the offline suite builds it (benchmarks/kvpact_systems.py `open_engine`,
--max-num-seqs 32 or the largest size, --max-model-len 512); for each size N, N requests of a 4-token
prompt and `--tokens` new tokens at once, and every model run with N sequences decoding timed on the
step thread (benchmarks/step_trace.py's tracer). Beside a busy process (`python3 -c "while True: pass"
&`) it shows what a shared core costs a step (docs/performance.md, "Batches of up to 64 rows").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from benchmarks.kvpact_systems import greedy_request, open_engine
from benchmarks.step_trace import traced
from kvpact.shared.intent import CacheDtype
from kvpact.worker.engine.engine import Engine
from kvpact.worker.loader.load import default_model_path

MAX_MODEL_LEN = 512


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
    parser.add_argument("--pa-cache-dtype", choices=[d.value for d in CacheDtype], default="auto")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with open_engine(
        model, "paged", MAX_MODEL_LEN, max(32, *sizes), 0, cache_dtype=CacheDtype(args.pa_cache_dtype)
    ) as engine:
        asyncio.run(_batch(engine, 2, 8))  # warm-up
        steps = traced(engine)
        print("| sequences | decode steps | median ms | min ms |\n|---:|---:|---:|---:|")
        for size in sizes:
            steps.clear()
            asyncio.run(_batch(engine, size, args.tokens))
            ms = [1000 * (s.ended - s.began) for s in steps if s.prompt_tokens == 0 and s.decodes == size]
            if not ms:  # the requests reached the step thread too far apart to all decode in one step
                print(f"| {size} | 0 | - | - |", flush=True)
                continue
            print(f"| {size} | {len(ms)} | {statistics.median(ms):.1f} | {min(ms):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
