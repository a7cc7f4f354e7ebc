"""The C decode attention (kernels/cpu_paged.c `kvp_decode_f32`) on a paged pool against an eager cache's
slots: whether reading K/V block by block costs paged anything by itself.

    python -m benchmarks.decode_attention [--seqs 32] [--contexts 76-356] [--placement ascending]
                                          [--cache-dtype float32|bfloat16]

One query token per sequence, the bundled model's heads (9 query, 3 KV, head size 64) unless told. Paged:
a pool of blocks of --block-size tokens, each sequence's prompt in blocks handed out one after another
and its last --tail tokens in blocks handed out after every prompt's (as decode grows them), the ids
in the order --placement says (ascending, descending, random); eager: one slot of --max-model-len
tokens per sequence (the eager cache's layout: one "block" per sequence). Both
run the same C function on the same queries; a step is --layers calls, each layer on pools of its own as
a model's are, so a step reads its K/V from memory, not from the CPU's caches (one pool for every
layer fit in L3 and hid what scattered blocks cost). Rounds alternate which goes
first; prints each one's median step and eager / paged (>= 1.0: paged as fast).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpact.kernels import cpu_paged


def contexts(seqs: int, spec: str) -> list[int]:
    """`seqs` context lengths spread evenly over "LO-HI" (one value: all alike)."""
    low, _, high = spec.partition("-")
    lo, hi = int(low), int(high or low)
    return [lo + ((hi - lo) * i) // max(1, seqs - 1) for i in range(seqs)]


PLACEMENTS = ("ascending", "descending", "random")


def paged_tables(
    lens: list[int], tail: int, block_size: int, width: int, placement: str = "ascending"
) -> torch.Tensor:
    """Block tables: each sequence's first len - tail tokens in blocks handed out one after another,
    then the tails'. The ids handed out, by `placement`: ascending (0, 1, 2, ...: a fresh pool),
    descending (a pool whose blocks came back in reverse, as a freed sequence's do), random (a seeded
    shuffle: a pool long in use)."""
    num_blocks = sum(-(-n // block_size) for n in lens)
    ids = list(range(num_blocks))
    if placement == "descending":
        ids.reverse()
    elif placement == "random":
        ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    handed = iter(ids)
    for first_pass in (True, False):
        for s, n in enumerate(lens):
            prompt_blocks = -(-max(1, n - tail) // block_size)
            blocks = range(prompt_blocks) if first_pass else range(prompt_blocks, -(-n // block_size))
            for b in blocks:
                tables[s, b] = next(handed)
    return tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--contexts", default="76-356", help="LO-HI tokens (engine_step's)")
    parser.add_argument("--tail", type=int, default=12, help="tokens per sequence decoded after every prompt")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--placement", choices=PLACEMENTS, default="ascending", help="block ids (paged)")
    parser.add_argument("--max-model-len", type=int, default=1472)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--cache-dtype", choices=("float32", "bfloat16"), default="float32", help="what both caches hold"
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.cache_dtype)
    ops = cpu_paged.required(torch.float32, torch.device("cpu"))
    q_heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    lens = contexts(args.seqs, args.contexts)
    if max(lens) > args.max_model_len:
        parser.error(f"--contexts reaches {max(lens)} tokens, past --max-model-len {args.max_model_len}")
    torch.manual_seed(0)
    query = torch.randn(args.seqs, q_heads, head_dim)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    width = -(-args.max_model_len // args.block_size)
    tables = paged_tables(lens, args.tail, args.block_size, width, args.placement)
    num_blocks = int(tables.max()) + 1
    # a K and a V pool per layer, as the model's: a step reads every layer's from memory, not from cache
    pools = [
        [torch.randn(num_blocks, args.block_size, kv_heads, head_dim).to(dtype) for _ in range(2)]
        for _ in range(args.layers)
    ]
    slots = [
        [torch.randn(args.seqs, args.max_model_len, kv_heads, head_dim).to(dtype) for _ in range(2)]
        for _ in range(args.layers)
    ]
    slot_tables = torch.arange(args.seqs, dtype=torch.int32).unsqueeze(1)
    out = torch.empty_like(query)
    scale = head_dim**-0.5
    caches = {"paged": (pools, tables), "eager": (slots, slot_tables)}

    def step_ms(name: str) -> float:
        layers, table = caches[name]
        started = time.perf_counter()
        for key, value in layers:
            ops.decode(query, key, value, table, context_lens, scale, out=out, check=False)
        return (time.perf_counter() - started) * 1e3

    times: dict[str, list[float]] = {"paged": [], "eager": []}
    for r in range(args.rounds):
        for name in ("paged", "eager") if r % 2 == 0 else ("eager", "paged"):
            times[name].append(step_ms(name))
    paged, eager = statistics.median(times["paged"]), statistics.median(times["eager"])
    span = f"{min(lens)}-{max(lens)}"
    print(f"{args.seqs} sequences, contexts {span}, {args.layers} layers, {args.rounds} rounds, "
          f"{args.cache_dtype} caches:")  # fmt: skip
    print(f"paged (block {args.block_size}, {args.placement}) {paged:.2f} ms, eager {eager:.2f} ms, "
          f"eager / paged {eager / paged:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
