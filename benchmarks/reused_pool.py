"""Decode steps of long prompts on a paged pool that has been used before, against the eager cache.

    python -m benchmarks.reused_pool [--blocks 0] [--rounds 4] [--model PATH]

A fresh paged pool hands out its never-used blocks first, in id order; once they are gone every block
comes from the free queue, in the order sequences freed them. This runs the offline suite's long_prompt
draw (4 requests, the throughput budget `--max-num-batched-tokens 2048`) on an in-process paged engine
whose pool holds only `--blocks` blocks (0: a quarter more than the 4 requests take at once),
twice to use it up, then `--rounds` rounds alternating with an
eager engine (which goes first alternates, prompts shifted each round), and prints each round's median
decode step with every sequence decoding, and eager / paged (>= 1.0: paged as fast). The probe behind
"Blocks handed out in ascending order" in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from benchmarks import workloads
from benchmarks.kvpact_systems import open_engine, run_engine
from benchmarks.step_trace import traced
from benchmarks.suites.kv_memory import worker_spec
from benchmarks.suites.offline import THROUGHPUT_BUDGET, shifted_prompts
from kvpact.shared.intent import PagedAttentionMode
from kvpact.worker.kv.sizing import kv_bytes_per_token
from kvpact.worker.loader.load import default_model_path, read_model_config
from kvpact.worker.startup.engine_setup import build_engine

BLOCK_SIZE, MAX_NUM_SEQS, REQUESTS, SEED = 16, 32, 4, 1234


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=0, help="the paged pool's blocks of 16 (0: derived)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    config = read_model_config(model)
    items = workloads.fit(
        workloads.long_prompt(REQUESTS, SEED, config.vocab_size), config.max_position_embeddings
    )
    max_model_len = -(-max(len(i.prompt) + i.max_tokens for i in items) // 64) * 64
    needed = sum(-(-(len(i.prompt) + i.max_tokens) // BLOCK_SIZE) for i in items)
    blocks = args.blocks or needed * 5 // 4
    bytes_per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, 4)  # fp32
    spec = worker_spec(
        model,
        "cpu",
        PagedAttentionMode.ON,
        max_model_len=max_model_len,
        max_num_seqs=MAX_NUM_SEQS,
        memory_bytes=blocks * BLOCK_SIZE * bytes_per_token,
    )
    with ExitStack() as stack:
        paged = stack.enter_context(build_engine(replace(spec, max_num_batched_tokens=THROUGHPUT_BUDGET)))
        eager = stack.enter_context(
            open_engine(model, "eager", max_model_len, MAX_NUM_SEQS, THROUGHPUT_BUDGET)
        )
        engines = {"paged": paged, "eager": eager}
        steps = {name: traced(engine) for name, engine in engines.items()}
        for r in range(2):  # use the pool up: from here on its blocks come from the free queue
            run_engine(paged, shifted_prompts(items, 100 + r, config.vocab_size))
        print(f"paged pool: {paged.step_loop.scheduler.num_total_blocks} blocks of {BLOCK_SIZE}; "
              f"{len(items)} requests, prompts {min(len(i.prompt) for i in items)}-"
              f"{max(len(i.prompt) for i in items)} tokens")  # fmt: skip
        ratios = []
        for r in range(args.rounds):
            median_ms = {}
            for name in ("paged", "eager") if r % 2 == 0 else ("eager", "paged"):
                steps[name].clear()
                shift = 200 + 2 * r + (name == "eager")
                run_engine(engines[name], shifted_prompts(items, shift, config.vocab_size))
                full = [s for s in steps[name] if not s.prompt_tokens and s.decodes == len(items)]
                median_ms[name] = statistics.median((s.ended - s.began) * 1e3 for s in full) if full else 0.0
            ratio = median_ms["eager"] / median_ms["paged"] if median_ms["paged"] else float("nan")
            ratios.append(ratio)
            print(f"round {r}: decode step of {len(items)} sequences, median: "
                  f"paged {median_ms['paged']:.3g} ms, eager {median_ms['eager']:.3g} ms, "
                  f"eager / paged {ratio:.2f}", flush=True)  # fmt: skip
        print(f"eager / paged, median of {len(ratios)} rounds: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
