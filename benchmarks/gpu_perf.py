"""Host work per layer and compiles after the warm-up, through the serving PagedAttentionStep.

    python benchmarks/gpu_perf.py --device cuda      (gpu_check.sh step f; --device cpu: a dry run)

Builds a PagedCache with Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head size 128,
bf16, block 16, max_model_len 4096; 8 layers), warms it up as a worker does
(worker/startup/kernel_warmup.py), then for decode batches of 1, 16 and 64 sequences at context 2048 times
one step: building its metadata, then every layer's `forward` (write, decode, merge) measured on the
host before synchronizing (CUDA launches are asynchronous, so that is the host's cost), then the
device time to finish. Ends with `RESULT host: PASS|WARN|FAIL ...`: FAIL if any kernel compiled after
the warm-up (serving would have stalled), WARN if the host time per layer exceeds the device time
per layer at batch 1 (the host, not the GPU, bounds the step).

On the CPU (--device cpu) the torch backend runs the same step with a smaller context: it only
proves this script runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:  # benchmarks/kernels.py shadows
    sys.path[0] = str(ROOT)

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 32, 8, 128, 16, 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from kvpact.shared.intent import PagedBackend
    from kvpact.worker.kv.paged import PagedAttentionStep, PagedCache
    from kvpact.worker.startup.kernel_warmup import warm_up_paged_kernels

    cuda = args.device == "cuda"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    context = 2048 if cuda else 64
    max_model_len = 4096 if cuda else 128
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = max(args.batches) * blocks_per_seq + 2
    backend = PagedBackend.TRITON if cuda else PagedBackend.TORCH
    cache = PagedCache(
        LAYERS,
        num_blocks,
        BLOCK_SIZE,
        KV_HEADS,
        HEAD_DIM,
        dtype,
        device,
        backend,
        max_model_len=max_model_len,
    )
    for pool in cache.key + cache.value:
        pool.normal_()
    if cuda:
        warm = warm_up_paged_kernels(cache, num_heads=Q_HEADS, dtype=dtype)
        print(f"warm-up: {warm.seconds:.1f}s, {warm.compiled} compiled: {', '.join(warm.variants)}")
    else:
        cache.mark_ready()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    verdicts = []
    print(f"{'batch':>5} {'splits':>6} | {'meta us':>8} {'host us/layer':>13} {'device us/layer':>15}")
    for batch in args.batches:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
        k = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
        v = torch.randn_like(k)
        best = None
        for _ in range(args.repeats + 1):  # the first round is a warm-up of the allocator
            sync()
            t0 = time.perf_counter()
            step = PagedAttentionStep(cache, tables, [context - 1] * batch, [1] * batch, batch)
            t1 = time.perf_counter()
            for layer in range(LAYERS):
                step.forward(layer, q, k, v)
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            times = ((t1 - t0) * 1e6, (t2 - t1) * 1e6 / LAYERS, (t3 - t1) * 1e6 / LAYERS)
            best = times if best is None or times[1] < best[1] else best
        assert best is not None
        meta, host, total = best
        print(f"{batch:5d} {step.decode_splits:6d} | {meta:8.0f} {host:13.1f} {total:15.1f}")
        if cuda and batch == min(args.batches) and host >= total * 0.9:
            verdicts.append(("WARN", f"batch {batch}: the host ({host:.0f} us/layer) bounds the step"))
    compiles = cache.kernel_compiles_after_ready()
    print(f"kernel compiles after the warm-up: {compiles}")
    if compiles:
        verdicts.append(("FAIL", f"{compiles} kernel compiles after the warm-up (serving would stall)"))
    worst = next((v for v in ("FAIL", "WARN") if any(x == v for x, _ in verdicts)), "PASS")
    why = (
        "; ".join(w for v, w in verdicts if v == worst)
        or f"0 compiles after the warm-up, batches {args.batches}"
    )
    print(f"RESULT host: {worst} {why}")
    return 1 if worst == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
