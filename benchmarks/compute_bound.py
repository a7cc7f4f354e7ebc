"""The compute bound: how many tokens per second this machine's matrix multiplies allow for a model.

    python -m benchmarks.compute_bound [--model PATH] [--size 2048] [--seconds 3]

A decoder forward pass costs about 2 x parameters FLOPs per token (one multiply-add per weight; the
attention scores add a little more for long sequences, the embedding lookup nothing, a tied LM head is
counted once because it is one matmul). So the tokens/s the machine allows is

    compute bound = FLOP/s of a large fp32 matmul / (2 x parameters)

where the FLOP/s is measured here, in the same run as the throughput it bounds, with the same threads
(`torch.get_num_threads()`): the best of several timed rounds of a SIZE x SIZE fp32 matmul (best, not
mean: on a shared machine the best round is the closest to what the cores can do). A serving system's
processed (prompt + output) tokens/s divided by this bound is its efficiency, a ratio that holds across
machines and loads where a time does not.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_SIZE = 2048
DEFAULT_SECONDS = 3.0


@dataclass(frozen=True, slots=True)
class ComputeBound:
    flops_per_s: float  # best fp32 matmul FLOP/s measured
    parameters: int  # the model's parameters, tied tensors counted once
    threads: int
    matmul_size: int

    @property
    def tokens_per_s(self) -> float:
        return self.flops_per_s / (2 * self.parameters)

    def line(self) -> str:
        return (
            f"compute bound {self.tokens_per_s:,.0f} tok/s = {self.flops_per_s / 1e9:.1f} GFLOP/s "
            f"(fp32 {self.matmul_size}x{self.matmul_size} matmul, {self.threads} threads) / "
            f"(2 x {self.parameters / 1e6:.1f} M parameters)"
        )


def matmul_flops(size: int = DEFAULT_SIZE, seconds: float = DEFAULT_SECONDS) -> float:
    """The best FLOP/s of `size` x `size` fp32 matmuls over rounds lasting about `seconds` in all."""
    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    out = torch.empty(size, size, dtype=torch.float32)
    flop = 2.0 * size**3
    with torch.inference_mode():
        torch.matmul(a, b, out=out)  # warm-up: thread pool, allocator
        best = 0.0
        deadline = time.perf_counter() + seconds
        rounds = 0
        while rounds < 3 or time.perf_counter() < deadline:
            started = time.perf_counter()
            torch.matmul(a, b, out=out)
            elapsed = time.perf_counter() - started
            best = max(best, flop / elapsed)
            rounds += 1
    return best


def count_parameters(module: torch.nn.Module) -> int:
    """Parameters of a torch module; tensors shared between modules (tied embeddings) count once."""
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    return total


def measure(parameters: int, size: int = DEFAULT_SIZE, seconds: float = DEFAULT_SECONDS) -> ComputeBound:
    return ComputeBound(matmul_flops(size, seconds), parameters, torch.get_num_threads(), size)


def model_parameters(model: Path) -> int:
    """The parameter count of a model file or directory, as transformers loads it (GGUF dequantized)."""
    from benchmarks.peers import load_transformers_model

    return count_parameters(load_transformers_model(model))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="matmul side (default 2048)")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="time to spend measuring")
    args = parser.parse_args(argv)
    if args.model:
        path = Path(args.model)
    else:
        from kvpact.worker.loader.load import default_model_path

        path = default_model_path()
    print(measure(model_parameters(path), args.size, args.seconds).line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
