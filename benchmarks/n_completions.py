"""n completions of one prompt (`n=4`) against 4 separate requests for it, on a paged engine: KV blocks
in use at peak, wall time, and prompt tokens actually computed (prefill).

    python -m benchmarks.n_completions [--quick] [--model PATH] [--out FILE.json]
                                       [--prompt-tokens N] [--max-tokens N]

One engine per configuration, built through worker.startup as `worker --paged-attn on` builds it (CPU,
default KV budget, block size 16). Each trial sends a fresh prompt (so no run finds the previous one in
the prefix cache) of PROMPT_TOKENS tokens, greedy, ignore_eos, MAX_TOKENS new tokens per completion:

    n=4                     one request, n=4: prefilled once, the 4 sequences fork its blocks
    4 requests              4 requests with that prompt, sent at once (prefix caching on, the default)
    4 requests, no cache    the same on an engine with --prefix-caching off

Peak blocks: the most pool blocks referenced at once during the run (benchmarks/kv_steps.py samples the
pool after every step). Wall time: submit to the last token, median of the trials. --quick: a short
prompt and output, one trial (the default suite's test runs it on the tiny model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.kv_steps import StepLog
from benchmarks.kvpact_systems import greedy_request
from kvpact.shared.features import FeatureIntents, FeatureMode
from kvpact.shared.intent import PagedAttentionMode, cache_intent
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.engine.engine import Engine
from kvpact.worker.loader import default_model_path
from kvpact.worker.startup.engine_setup import build_engine

N = 4


@dataclass(frozen=True, slots=True)
class Scale:
    prompt_tokens: int
    max_tokens: int
    trials: int
    max_model_len: int


FULL = Scale(prompt_tokens=512, max_tokens=64, trials=3, max_model_len=2048)
QUICK = Scale(prompt_tokens=40, max_tokens=8, trials=1, max_model_len=128)


@dataclass(frozen=True, slots=True)
class Row:
    config: str
    peak_blocks: int
    wall_s: float
    prompt_tokens_computed: int
    completion_tokens: int


def open_engine(model: Path, scale: Scale, prefix_caching: bool) -> Engine:
    prefix = FeatureIntents(prefix_caching=FeatureMode.AUTO if prefix_caching else FeatureMode.OFF)
    spec = WorkerSpec(model=str(model), device="cpu", max_model_len=scale.max_model_len, max_num_seqs=8)
    return build_engine(replace(spec, cache=cache_intent(PagedAttentionMode.ON), features=prefix))


def trial(engine: Engine, log: StepLog, prompt: tuple[int, ...], scale: Scale, together: bool) -> Row:
    first = len(log.snapshot())
    started = time.monotonic()
    if together:
        request = replace(greedy_request("n4", prompt, scale.max_tokens), n=N)
        (choices,) = engine.run_choices([request])
        usages = [choices[0].usage]
    else:
        results = engine.run([greedy_request(f"r{i}", prompt, scale.max_tokens) for i in range(N)])
        usages = [r.usage for r in results]
    wall = time.monotonic() - started
    peak = max(s.blocks_in_use for s in log.snapshot()[first:])
    computed = sum(u.prompt_tokens - u.cached_prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    return Row("", peak, wall, computed, generated)


def measure(model: Path, scale: Scale) -> list[Row]:
    configs = [
        ("n=4", True, True),
        ("4 requests", False, True),
        ("4 requests, no prefix cache", False, False),
    ]
    rows = []
    for c, (name, together, prefix_caching) in enumerate(configs):
        with open_engine(model, scale, prefix_caching) as engine:
            log = StepLog.attach(engine, scale.max_model_len)
            engine.run([greedy_request("warmup", (7, 8, 9), 2)])
            runs = []
            for t in range(scale.trials):
                offset = 1000 + 7919 * (c * scale.trials + t)
                prompt = tuple((offset + 31 * i) % engine.vocab_size for i in range(scale.prompt_tokens))
                runs.append(trial(engine, log, prompt, scale, together))
            rows.append(
                Row(
                    name,
                    max(r.peak_blocks for r in runs),
                    statistics.median(r.wall_s for r in runs),
                    runs[0].prompt_tokens_computed,
                    runs[0].completion_tokens,
                )
            )
    return rows


def table(rows: list[Row], scale: Scale) -> str:
    lines = [
        f"prompt {scale.prompt_tokens} tokens, {N} completions of {scale.max_tokens} tokens, block size 16",
        "",
        "| configuration | peak KV blocks | wall time (s) | prompt tokens computed |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r.config} | {r.peak_blocks} | {r.wall_s:.2f} | {r.prompt_tokens_computed} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.n_completions", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a short prompt and output, one trial")
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--out", default="", help="also write the rows as JSON to this file")
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help=f"prompt length (default {FULL.prompt_tokens})"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=0, help=f"tokens per completion (default {FULL.max_tokens})"
    )
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else FULL
    if args.prompt_tokens:
        scale = replace(scale, prompt_tokens=args.prompt_tokens)
    if args.max_tokens:
        scale = replace(scale, max_tokens=args.max_tokens)
    model = Path(args.model) if args.model else default_model_path()
    rows = measure(model, scale)
    print(table(rows, scale))
    if args.out:
        Path(args.out).write_text(
            json.dumps({"scale": asdict(scale), "rows": [asdict(r) for r in rows]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
