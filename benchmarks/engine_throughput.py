"""Decode throughput of the engine, paged vs eager, at several concurrencies.

    python -m benchmarks.engine_throughput [--concurrency 1,16,32] [--max-tokens 64] [--prompt-tokens 32]

For each cache (eager: --paged-attn off; paged: --paged-attn on, the torch backend on CPU) one engine
is built through worker.engine_setup with the same --max-num-seqs (default 32, so eager is not capped by
its 8-slot CPU default), warmed up, then for each concurrency N, N requests with distinct prompts of
--prompt-tokens tokens are submitted at once (greedy, ignore_eos, --max-tokens each).

decode tok/s = tokens sampled after the last request got its first token / the time from then to the
last request's end (prefill excluded); total tok/s = all sampled tokens / wall time from submission.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch

from kvpact.shared.intent import PagedAttentionMode, cache_intent
from kvpact.shared.log import configure_logging
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine import Engine
from kvpact.worker.engine_setup import build_engine
from kvpact.worker.request import GenerationOutput, GenerationRequest, SamplingParams

MEASURE_TIMEOUT_S = 1800.0


@dataclass(slots=True)
class Row:
    cache: str
    concurrency: int
    decode_tps: float
    total_tps: float
    first_token_s: float
    wall_s: float
    preemptions: int


def measure(
    engine: Engine,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    tag: str,
    timeout_s: float = MEASURE_TIMEOUT_S,
) -> Row:
    """Raises SystemExit naming the first request that failed, TimeoutError past `timeout_s`."""
    vocab = engine.vocab_size
    times: dict[str, list[float]] = {}
    failures: list[str] = []
    done = threading.Semaphore(0)

    def sink_for(rid: str):
        def sink(item: GenerationOutput | BaseException) -> None:
            # Called on the engine's step thread: report to the waiting thread, never raise here.
            if isinstance(item, BaseException):
                failures.append(f"request {rid} failed: {item}")
                done.release()
                return
            times[rid].extend([time.perf_counter()] * len(item.token_ids))
            if item.finish_reason is not None:
                done.release()

        return sink

    preempted = engine.stats().num_preemptions
    start = time.perf_counter()
    for i in range(concurrency):
        rid = f"{tag}-{i}"
        times[rid] = []
        prompt = tuple((1000 + 7919 * i + 31 * j) % vocab for j in range(prompt_tokens))
        request = GenerationRequest(
            rid, prompt, SamplingParams(temperature=0), max_tokens=max_tokens, ignore_eos=True
        )
        engine.submit(request, sink_for(rid))
    deadline = time.monotonic() + timeout_s
    for _ in range(concurrency):
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{tag}: {concurrency} requests did not finish within {timeout_s:g} s")
    if failures:
        raise SystemExit(failures[0])
    end = max(t[-1] for t in times.values())
    decode_start = max(t[0] for t in times.values())
    decode_tokens = sum(1 for t in times.values() for x in t if x > decode_start)
    total = sum(len(t) for t in times.values())
    return Row(
        cache=engine.realized.kind.value,
        concurrency=concurrency,
        decode_tps=decode_tokens / (end - decode_start) if end > decode_start else float("nan"),
        total_tps=total / (end - start),
        first_token_s=decode_start - start,
        wall_s=end - start,
        preemptions=engine.stats().num_preemptions - preempted,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", default="1,16,32", help="comma-separated request counts")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=0, help="0 = the device default")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--caches", default="eager,paged", help="which of eager,paged to run")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    configure_logging("console", "WARNING")  # logs to stderr; the table alone on stdout

    command = "python -m benchmarks.engine_throughput " + " ".join(
        map(shlex.quote, sys.argv[1:] if argv is None else argv)
    )
    print(f"# {command}")
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
        f"prompt {args.prompt_tokens} tokens, {args.max_tokens} new tokens per request, greedy"
    )
    base = WorkerSpec(
        model=args.model, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs
    )
    modes = {"eager": PagedAttentionMode.OFF, "paged": PagedAttentionMode.ON}
    rows: list[Row] = []
    for name in args.caches.split(","):
        engine = build_engine(replace(base, cache=cache_intent(modes[name])))
        with engine:
            r = engine.realized
            print(
                f"# {name}: {r.kind.value} cache, backend {r.backend.value if r.backend else 'eager'}, "
                f"{r.num_blocks} {'blocks' if r.block_size else 'slots'}, {r.memory_bytes / 2**20:.0f} MiB, "
                f"max_model_len {r.max_model_len}, model {engine.model_name}"
            )
            measure(engine, 2, args.prompt_tokens, 8, f"{name}-warmup")
            for n in levels:
                rows.append(measure(engine, n, args.prompt_tokens, args.max_tokens, f"{name}-{n}"))
                print(f"#   done: {name} x {n}", flush=True)
    print()
    print("| cache | concurrent | decode tok/s | total tok/s | first token s | wall s | preemptions |")
    print("|-------|-----------:|-------------:|------------:|--------------:|-------:|------------:|")
    for row in rows:
        print(
            f"| {row.cache} | {row.concurrency} | {row.decode_tps:.1f} | {row.total_tps:.1f} | "
            f"{row.first_token_s:.2f} | {row.wall_s:.2f} | {row.preemptions} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
