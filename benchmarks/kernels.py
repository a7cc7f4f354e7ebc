"""Paged decode attention: Triton kernel vs the torch reference.

    python benchmarks/kernels.py            (or python -m benchmarks.kernels)

On CUDA: first the small correctness pass below, compiled on the GPU (fp32, fp16 and the native
bf16 tl.dot path); then batch 1/16/64/256 x context 512/2k/8k, GQA 32:8, head 128, bf16, block 16:
time, achieved GB/s of K/V read, the fraction of the device's peak memory bandwidth (when the
device is in PEAK_GBPS) and the max difference from the reference. Each Triton call is timed twice:
launched one call at a time (`triton.testing.do_bench`: L2 flushed between calls, the Python launch of
its two kernels inside the time whenever the GPU outruns it) and replayed from a CUDA graph
(`do_bench_cudagraph`: back to back, no launch cost), which is how the engine's decode step runs under
`--cuda-graphs`. Without the flush, a case whose K/V fits the L2 (50 MB on an H100/H200: batch x context
<= about 12k tokens here) reads from it and can show more than the peak; the headline case (batch 64 x
2k, 537 MB in bf16) does not. Exits 1 when the correctness
pass fails (the table is still printed). Without CUDA: re-runs itself under TRITON_INTERPRET=1 for
the correctness pass alone; exits 0 when it passes, 1 when not.
"""

import argparse
import functools
import os
import sys
from pathlib import Path

# This file is named kernels.py: run as a script, its folder would shadow the `kernels` package.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

# Peak HBM bandwidth (GB/s) by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_GBPS = (
    ("H200", 4800),
    ("H100 NVL", 3900),
    ("H100 PCIe", 2000),
    ("H100", 3350),  # SXM
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),  # 40GB SXM4 / PCIe
    ("L40S", 864),
    ("A10G", 600),
    ("L4", 300),
)
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def peak_gbps(device_name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key in device_name), None)


def share(gbps: float, peak: float | None) -> str:
    return f"{100 * gbps / peak:5.1f}%" if peak else "n/a"


def decode_inputs(batch: int, context: int, block_size: int, dtype: torch.dtype, device: str):
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device)  # scattered blocks, as after some churn
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=dtype, device=device)
    return query, key_cache, value_cache, block_tables, context_lens, HEAD_DIM**-0.5


def benchmark(args: argparse.Namespace) -> int:
    import triton
    import triton.testing

    from kvpact.kernels import paged_decode_attention
    from kvpact.kernels.reference import paged_decode_attention_torch
    from kvpact.kernels.splits import default_num_splits

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    peak = peak_gbps(name)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{name} ({num_sms} SMs), peak {peak or 'n/a'} GB/s")
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"decode: GQA {Q_HEADS}:{KV_HEADS}, head {HEAD_DIM}, {args.dtype}, block {args.block_size}\n")
    header = (
        f"{'batch':>5} {'context':>7} {'splits':>6} | {'triton ms':>9} {'GB/s':>7} {'% peak':>6} | "
        f"{'graph ms':>9} {'GB/s':>7} {'% peak':>6} | "
        f"{'torch ms':>9} {'GB/s':>7} | {'speedup':>7} {'max err':>8}"
    )
    print(header)
    print("-" * len(header))
    headline = ""
    for batch in args.batches:
        for context in args.contexts:
            inputs = decode_inputs(batch, context, args.block_size, dtype, "cuda")
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * inputs[1].element_size()
            splits = default_num_splits(batch, KV_HEADS, context, num_sms)  # what num_splits=None runs
            out = paged_decode_attention(*inputs)
            call = functools.partial(paged_decode_attention, *inputs)
            t_ms = triton.testing.do_bench(call)
            gbps = kv_bytes / t_ms / 1e6
            pct = share(gbps, peak)
            try:
                g_ms = triton.testing.do_bench_cudagraph(call)
                g_gbps = kv_bytes / g_ms / 1e6
                graphed = f"{g_ms:9.3f} {g_gbps:7.0f} {share(g_gbps, peak):>6}"
            except Exception as exc:  # the table goes on; the failure is named under its row
                g_gbps, graphed = None, f"{'capture failed':>24}"
                capture_error = f"{type(exc).__name__}: {exc}"
            else:
                capture_error = ""
            # The reference materializes fp32 copies of every sequence's K/V: skip it when that cannot fit.
            ref_bytes = 3 * kv_bytes * (1 + 4 / inputs[1].element_size())
            reference = functools.partial(paged_decode_attention_torch, *inputs)
            if ref_bytes < 0.8 * torch.cuda.mem_get_info()[0]:
                err = (out.float() - reference().float()).abs().max().item()
                r_ms = triton.testing.do_bench(reference, rep=50)
                ref = f"{r_ms:9.3f} {kv_bytes / r_ms / 1e6:7.0f} | {r_ms / t_ms:6.1f}x {err:8.1e}"
            else:
                ref = f"{'(skip)':>9} {'':>7} | {'':>7} {'':>8}"
            launched = f"{t_ms:9.3f} {gbps:7.0f} {pct:>6}"
            print(f"{batch:5d} {context:7d} {splits:6d} | {launched} | {graphed} | {ref}")
            if capture_error:
                print(f"      the CUDA graph capture failed: {capture_error}")
            if (batch, context) == (64, 2048):  # the yardstick (gpu_check.sh's summary shows it)
                replayed = (
                    f"{g_gbps:.0f} GB/s = {share(g_gbps, peak).strip()} replayed in a CUDA graph "
                    "(as the engine decodes)"
                    if g_gbps
                    else "its CUDA graph capture failed (see the table)"
                )
                headline = (
                    f"decode bandwidth at batch 64, context 2048: {gbps:.0f} GB/s = {pct.strip()} of peak "
                    f"launched one call at a time; {replayed}"
                )
            del inputs, out, reference
            torch.cuda.empty_cache()
    if headline:
        print(headline)
    return 0


TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = tuple(TOLERANCE)


def correctness_pass(device: str = "cpu", dtypes: tuple[torch.dtype, ...] = DTYPES) -> int:
    """A few small shapes (the interpreter on the CPU, compiled on CUDA); the comparisons of tests/kernels."""
    from kvpact.kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache
    from kvpact.kernels.reference import (
        paged_decode_attention_torch,
        paged_prefill_attention_torch,
        reshape_and_cache_torch,
    )

    torch.manual_seed(0)
    kv_heads, group, head_dim, block_size = 2, 4, 128, 16
    context_lens = [1, 16, 17, 150]
    failures = 0
    for dtype in dtypes:
        tol = TOLERANCE[dtype]
        total = sum(context_lens)
        num_blocks = sum(-(-n // block_size) for n in context_lens)
        key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        value_cache = torch.zeros_like(key_cache)
        key = torch.randn(total, kv_heads, head_dim).to(dtype).to(device)
        value = torch.randn(total, kv_heads, head_dim).to(dtype).to(device)
        block_tables = torch.zeros(
            len(context_lens), max(-(-n // block_size) for n in context_lens), dtype=torch.int32
        )
        slots, next_block = [], 0
        for i, n in enumerate(context_lens):
            for b in range(-(-n // block_size)):
                block_tables[i, b] = next_block
                next_block += 1
            slots += [int(block_tables[i, p // block_size]) * block_size + p % block_size for p in range(n)]
        slot_mapping = torch.tensor(slots).to(device)
        block_tables = block_tables.to(device)
        ref_k, ref_v = key_cache.clone(), value_cache.clone()
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        reshape_and_cache_torch(key, value, ref_k, ref_v, slot_mapping)
        lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
        cache = (key_cache, value_cache, block_tables)
        query = torch.randn(len(context_lens), kv_heads * group, head_dim).to(dtype).to(device)
        prefill_query = torch.randn(total, kv_heads * group, head_dim).to(dtype).to(device)
        offsets = [0, *torch.tensor(context_lens).cumsum(0).tolist()]
        qsl = torch.tensor(offsets, dtype=torch.int32, device=device)
        checks = {
            "reshape_and_cache": max(
                (key_cache.float() - ref_k.float()).abs().max().item(),
                (value_cache.float() - ref_v.float()).abs().max().item(),
            ),
            "decode (2 splits)": (
                paged_decode_attention(query, *cache, lens, head_dim**-0.5, num_splits=2).float()
                - paged_decode_attention_torch(query, *cache, lens, head_dim**-0.5).float()
            )
            .abs()
            .max()
            .item(),
            "prefill": (
                paged_prefill_attention(prefill_query, *cache, qsl, lens, head_dim**-0.5).float()
                - paged_prefill_attention_torch(prefill_query, *cache, qsl, lens, head_dim**-0.5).float()
            )
            .abs()
            .max()
            .item(),
        }
        for kernel, err in checks.items():
            ok = err <= tol
            failures += not ok
            print(
                f"  {str(dtype).removeprefix('torch.'):>8} {kernel:<18} max |triton - torch| {err:.1e}  "
                f"{'ok' if ok else f'FAIL (> {tol})'}"
            )
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--quick", action="store_true", help="without CUDA: the correctness pass in float32 only"
    )
    args = parser.parse_args()
    if torch.cuda.is_available():
        print("correctness on the GPU (compiled kernels vs the torch reference):", flush=True)
        failed = correctness_pass("cuda")
        print(flush=True)
        return benchmark(args) or failed
    if os.environ.get("TRITON_INTERPRET") != "1":
        # TRITON_INTERPRET is read when triton is imported: start over with it set.
        print(
            "no CUDA device present: running a small correctness pass under the Triton interpreter",
            flush=True,
        )
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    return correctness_pass(dtypes=(torch.float32,) if args.quick else DTYPES)


if __name__ == "__main__":
    sys.exit(main())
