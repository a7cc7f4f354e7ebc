"""Tensor parallelism on this machine (CPU, gloo): at TP=1 and TP=N, the engine's step time, the share of
rank 0's step spent in all-reduce, and the memory one rank holds (its weights and its KV cache).

    python benchmarks/tensor_parallel.py                      # the default model (SmolLM2: 9 heads) at 1, 3
    python benchmarks/tensor_parallel.py --model DIR --sizes 1 2

The workload: 4 greedy requests of 32 tokens, run twice (the first run warms up, the second is timed).
All-reduce time is what rank 0 waits in `dist.all_reduce`, which includes waiting for the slowest rank:
on a machine whose cores the ranks share, that is mostly the other ranks' compute. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["The quick brown fox", "Tensor parallelism splits", "Once upon a time", "A haiku about CPUs"]
NEW_TOKENS = 32


def measure(model: str, size: int) -> dict[str, Any]:
    from kvpact.shared.spec import WorkerSpec
    from kvpact.worker.engine.request import GenerationRequest, SamplingParams
    from kvpact.worker.startup.engine_setup import build_engine

    spec = replace(
        WorkerSpec(model=model, device="cpu", max_model_len=256, max_num_seqs=4), tensor_parallel_size=size
    )
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))  # rank 0's part, as the worker's
    engine = build_engine(spec)
    runner = engine.step_loop.runner
    timed = {"reduce": 0.0, "steps": 0, "step": 0.0}
    layers: list[Any] = list(runner.model.model.layers)
    for layer in layers:
        for module in (layer.self_attn, layer.mlp):
            inner = module.reduce
            if inner is not None:

                def reduce(t, inner=inner):
                    started = time.perf_counter()
                    out = inner(t)
                    timed["reduce"] += time.perf_counter() - started
                    return out

                module.reduce = reduce
    run = runner.run

    def counted(chunks):
        started = time.perf_counter()
        out = run(chunks)
        timed["step"] += time.perf_counter() - started
        timed["steps"] += 1
        return out

    runner.run = counted  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0)

    def requests(tag: str) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}", p, greedy, max_tokens=NEW_TOKENS, ignore_eos=True)
                for i, p in enumerate(PROMPTS)]  # fmt: skip

    engine.run(requests("warm"), timeout=600)
    timed.update(reduce=0.0, steps=0, step=0.0)
    started = time.perf_counter()
    results = engine.run(requests("timed"), timeout=600)
    wall = time.perf_counter() - started
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    row = {
        "size": size,
        "step_ms": 1000 * timed["step"] / max(1, timed["steps"]),
        "reduce_share": timed["reduce"] / timed["step"] if timed["step"] else 0.0,
        "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
        "weights_mib": weights / 2**20,
        "kv_mib": runner.cache.memory_bytes / 2**20,
        "tokens": [r.token_ids for r in results],
    }
    engine.close()
    if runner.ranks is not None:
        runner.ranks.close()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="a model path (default: the bundled SmolLM2-135M)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    rows = [measure(args.model, size) for size in args.sizes]
    print("| TP | step (ms) | all-reduce share (rank 0) | tokens/s | weights/rank (MiB) | KV/rank (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        share = f"{100 * r['reduce_share']:.0f}%"
        print(f"| {r['size']} | {r['step_ms']:.1f} | {share} | {r['tokens_per_s']:.1f} | "
              f"{r['weights_mib']:.1f} | {r['kv_mib']:.1f} |")  # fmt: skip
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"greedy tokens equal across sizes: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
