"""The C kernels' linear layers (kernels/cpu_paged.py: `linear` on [out, in] weights, `packed_linear`
on packed ones) against torch's matmul, on a model's own weight shapes: where `SMALL_BATCH_ROWS` comes
from, and what packing the projections buys.

    python -m benchmarks.small_linear [--model PATH] [--rows 1,4,8,16,32,48,64,96,512] [--rounds 3]
        [--dtype float32|bfloat16]

Every projection of every layer and the LM head, random float32 weights of the model's shapes, one
batch of ROWS random inputs; the best of ROUNDS passes over all of them (best, not mean: on a shared
machine the best round is the closest to what the cores can do), torch's threads as set. Rows past
SMALL_BATCH_ROWS are measured in C too (the limit lifted for this script), so the crossover shows. The
packed column packs what the engine packs (every projection and the LM head, worker/startup/
engine_setup.py `use_cpu_kernels`); it is blank on a build without panels (kvp_panel_width 0: not
AVX-512). `--dtype bfloat16`: a bf16 model's weights and inputs, packed in pairs, against torch's bf16
matmul (the [out, in] C kernel takes float32 only: its column is blank).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpact.kernels import cpu_paged
from kvpact.worker.loader import read_model_config


def weight_shapes(model: Path) -> list[tuple[int, int]]:
    c = read_model_config(model)
    layer = [
        (c.q_size + 2 * c.kv_size, c.hidden_size),
        (c.hidden_size, c.q_size),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    return layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


def measure(
    shapes: list[tuple[int, int]], rows: int, rounds: int, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """{"C" (float32), "packed" (where the build packs), "torch"}: ms, the best pass over every shape."""
    loaded = cpu_paged.load(torch.float32, torch.device("cpu"))
    if isinstance(loaded, str):
        raise SystemExit(f"the C kernels cannot run here: {loaded}")
    weights = [torch.randn(shape).to(dtype) for shape in shapes]
    inputs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}
    packed = [(w.shape[1], loaded.pack(w)) for w in weights] if loaded.panel_width else []

    def run_packed() -> None:
        for in_features, p in packed:
            loaded.packed_linear(inputs[in_features], p)

    def run(matmul: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def one_pass() -> None:
            for w in weights:
                matmul(inputs[w.shape[1]], w, None)

        return one_pass

    passes = {"torch": run(F.linear)}
    if dtype is torch.float32:
        passes["C"] = run(loaded.linear)
    if packed:
        passes["packed"] = run_packed
    limit, cpu_paged.SMALL_BATCH_ROWS = cpu_paged.SMALL_BATCH_ROWS, max(rows, cpu_paged.SMALL_BATCH_ROWS)
    try:
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(rounds):
            for name, one_pass in passes.items():
                start = time.perf_counter()
                one_pass()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    finally:
        cpu_paged.SMALL_BATCH_ROWS = limit
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--rows", default="1,4,8,16,32,48,64,96,512", help="batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="passes per batch size (the best counts)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and inputs"
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.model:
        path = Path(args.model)
    else:
        from kvpact.worker.loader.load import default_model_path

        path = default_model_path()
    shapes = weight_shapes(path)
    print(
        f"{len(shapes)} {args.dtype} weight matrices of {path.name}, {torch.get_num_threads()} torch threads"
    )
    print("| rows | C ms | C packed ms | torch ms | C / torch | packed / torch |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        ms = measure(shapes, rows, args.rounds, dtype)
        c, t, p = ms.get("C"), ms["torch"], ms.get("packed")
        ratios = " | ".join(f"{x / t:.2f}" if x else "" for x in (c, p))
        cells = " | ".join(f"{x:.1f}" if x else "" for x in (c, p, t))
        print(f"| {rows} | {cells} | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
