"""The third-party client vs the suite's client: guidellm and `stream_http` against one router's HTTP
front, back to back in the same run, at the same concurrency, prompt and output lengths.

    compare(cluster, model, scale, seed, command)   the table, its targets and data
    python -m benchmarks.client_agreement [--quick] [--concurrency 4,16]   just this table

For each concurrency the suite's client runs, then guidellm, then the suite's client again (ours,
guidellm, ours: a drift during the run moves both of ours, and guidellm is compared with their mean).
Both send the same request body (GUIDELLM_BODY) and the same kind of requests, and count the same way
(thirdparty.ClientFigures): TTFT p50 over requests, output tok/s = output tokens / (last token - first
request sent). The requests (workloads.text_items) are text prompts, corpus windows decoded by the
model's tokenizer.json, `prompt_tokens` long; guidellm reads them from a JSONL file (prompt, prompt and
output token counts), in order. Output lengths are spread over [output/2, 3*output/2] and are the same
sequence in all three runs; each run has prompts of its own, so the prefix cache helps none. Why spread:
with one output length, a closed loop keeps the slots in lockstep, every request of a wave ending on the
same step, so the whole run repeats how its first wave happened to split into prefill batches; our
client's first wave went out as 1 + 15 requests at concurrency 16, guidellm's (its worker processes
starting) as 3 + 13, and TTFT p50 is the big batch's prefill, ~13/15 of ours (docs/performance.md).
Where guidellm cannot be installed (no PyPI) or has no tokenizer, the table says so in one row and its
targets are not measured.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks import thirdparty, workloads
from benchmarks.framework import Table, Target
from benchmarks.kvpact_systems import Cluster, stream_http
from benchmarks.thirdparty import ClientFigures

AGREE_WITHIN = 0.10
TARGET = "third-party client agrees within 10%"
GOAL = f"guidellm / ours in [{1 - AGREE_WITHIN:g}, {1 + AGREE_WITHIN:g}]"
FIGURES = ("TTFT p50", "output tok/s")
COLUMNS = ["concurrency", "client", "requests", "prompt tokens", "output tokens"]
COLUMNS += ["TTFT p50 s", "output tok/s", "in flight", "client CPU s"]
NAN = float("nan")
# what guidellm 0.2.1 sends besides prompt and max_tokens (backend/openai.py): no temperature, so the
# server samples at its default 1.0 for both clients; greedy alone ran ~20% faster here
GUIDELLM_BODY = {"stream": True, "stream_options": {"include_usage": True}, "stop": None, "ignore_eos": True}


@dataclass(frozen=True, slots=True)
class Scale:
    concurrencies: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int
    requests_per_slot: int  # each run sends concurrency x this many requests


@dataclass(slots=True)
class Agreement:
    table: Table
    targets: list[Target] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def ours(cluster: Cluster, items: list[workloads.TextItem], concurrency: int) -> ClientFigures:
    cpu = time.process_time()  # this process runs nothing else meanwhile
    streamed = asyncio.run(stream_http(cluster.http_address, items, concurrency, body=GUIDELLM_BODY))
    cpu = time.process_time() - cpu
    wall = max(s.token_times[-1] for s in streamed) - min(s.sent for s in streamed)
    return ClientFigures(
        requests=len(streamed),
        prompt_tokens=sum(i.prompt_tokens for i in items) / len(items),
        ttft_p50_s=median(s.ttft for s in streamed),
        output_tok_s=sum(len(s.tokens) for s in streamed) / wall,
        in_flight=sum(s.token_times[-1] - s.sent for s in streamed) / wall,
        cpu_s=cpu,
    )


def compare(cluster: Cluster, model: Path, scale: Scale, seed: int, command: str) -> Agreement:
    title = "Third-party client vs the suite's client (guidellm and stream_http, one router's HTTP front)"
    notes = [
        f"guidellm {thirdparty.GUIDELLM_VERSION} (its own venv, {thirdparty.clients_root()}), "
        f"--rate-type concurrent, GUIDELLM__DEFAULT_ASYNC_LOOP_SLEEP="
        f"{os.environ.get('GUIDELLM__DEFAULT_ASYNC_LOOP_SLEEP', thirdparty.LOOP_SLEEP_S)}; ours: "
        "benchmarks/kvpact_systems.stream_http, the same closed loop, the same request body as guidellm's "
        "(no temperature: the server's default 1.0)",
        f"prompt {scale.prompt_tokens} tokens of text, output {scale.output_tokens // 2}-"
        f"{scale.output_tokens * 3 // 2} (ignore_eos), the same lengths in the same order for all three runs "
        "(guidellm reads them from a JSONL file in order), each run its own prompts; run order ours, "
        "guidellm, ours; 'guidellm / ours' divides by the mean of our two runs",
        "both counted alike: TTFT p50 over requests (sent -> first streamed text); output tok/s = output "
        "tokens / (last token - first request sent); prompt tokens: ours by the tokenizer, guidellm's the "
        "server's usage count",
        "in flight = the requests' spans (sent -> last token) / wall: how full the client kept its "
        "slots; client CPU s: what the client itself burned (guidellm's includes its start-up), CPU the "
        "server on the same machine did not get",
    ]
    exe = thirdparty.ensure_guidellm()
    processor = thirdparty.tokenizer_dir(model)
    why = exe if isinstance(exe, str) else None
    if why is None and processor is None:
        why = f"no tokenizer.json for {model} (guidellm's --processor); load it in a worker once"
    if why is not None:
        row = ["-", f"guidellm not installed: {why}"] + [NAN] * (len(COLUMNS) - 2)
        missing = [Target(TARGET, "TTFT p50, output tok/s", "not run", None, why)]
        return Agreement(Table(title, COLUMNS, [row], command, notes), missing, {"guidellm": why})
    assert not isinstance(exe, str) and processor is not None
    rows: list[list[Any]] = []
    targets: list[Target] = []
    runs: list[dict[str, Any]] = []
    for k, concurrency in enumerate(scale.concurrencies):
        run = _at(cluster, exe, processor, scale, concurrency, seed + 100 * k)
        rows += run.pop("rows")
        targets += run.pop("targets")
        notes += run.pop("notes")
        runs.append(run)
    notes.append(
        "guidellm's own summary output_tokens_per_second is a time-binned rate, not tokens / wall; it "
        "is in the JSON as reported_output_tok_s"
    )
    return Agreement(Table(title, COLUMNS, rows, command, notes), targets, {"runs": _jsonable(runs)})


def _at(
    cluster: Cluster, exe: Path, processor: Path, scale: Scale, concurrency: int, seed: int
) -> dict[str, Any]:
    """ours, guidellm, ours at one concurrency: its rows, targets, notes and figures."""
    n = concurrency * scale.requests_per_slot
    shape = (scale.prompt_tokens, scale.output_tokens)
    # the same lengths in the same order for all three runs (lengths seed `seed`), prompts of their own
    runs = [workloads.text_items(processor / "tokenizer.json", n, seed + k, seed, *shape) for k in (1, 2, 3)]
    first = ours(cluster, runs[0], concurrency)
    try:
        theirs: ClientFigures | str = thirdparty.run_guidellm(
            exe, cluster.http_address, processor, runs[1], concurrency, seed
        )
    except RuntimeError as e:
        theirs = str(e)
    second = ours(cluster, runs[2], concurrency)
    mean_output = sum(i.max_tokens for i in runs[0]) / n
    rows: list[list[Any]] = []
    for name, f in (("ours (1st)", first), ("guidellm", theirs), ("ours (2nd)", second)):
        if isinstance(f, str):
            rows.append([concurrency, f"guidellm failed: {f[-300:]}"] + [NAN] * (len(COLUMNS) - 2))
        else:
            rows.append([concurrency, name, f.requests, f.prompt_tokens, mean_output]
                        + [f.ttft_p50_s, f.output_tok_s, f.in_flight, f.cpu_s])  # fmt: skip
    run: dict[str, Any] = {"concurrency": concurrency, "requests": n, "ours": [first, second]}
    run.update(rows=rows, targets=[], notes=[])
    if isinstance(theirs, str):
        run["guidellm_error"] = theirs
        for figure in FIGURES:
            name = f"{TARGET}: {figure} (concurrency {concurrency})"
            run["targets"].append(Target(name, GOAL, "guidellm failed", False, theirs[-200:]))
        return run
    ratios = {
        "TTFT p50": theirs.ttft_p50_s / ((first.ttft_p50_s + second.ttft_p50_s) / 2),
        "output tok/s": theirs.output_tok_s / ((first.output_tok_s + second.output_tok_s) / 2),
    }
    rows.append(
        [concurrency, "guidellm / ours", "", "", "", ratios["TTFT p50"], ratios["output tok/s"], "", ""]
    )
    drift = (
        f"our two runs differ by {abs(first.ttft_p50_s / second.ttft_p50_s - 1):.0%} (TTFT), "
        f"{abs(first.output_tok_s / second.output_tok_s - 1):.0%} (tok/s)"
    )
    for figure, ratio in ratios.items():
        name = f"{TARGET}: {figure} (concurrency {concurrency})"
        run["targets"].append(Target(name, GOAL, f"{ratio:.3f}", abs(ratio - 1) <= AGREE_WITHIN, drift))
    if abs(theirs.prompt_tokens - scale.prompt_tokens) > 0.5:
        run["notes"].append(
            f"concurrency {concurrency}: guidellm's prompts came to {theirs.prompt_tokens:.1f} tokens "
            f"by the server's count (asked for {scale.prompt_tokens}): its --processor text does not "
            "re-tokenize to the same length"
        )
    run.update(guidellm=theirs, ratios=ratios)
    return run


def _jsonable(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def one(value: Any) -> Any:
        if isinstance(value, ClientFigures):
            return {k: getattr(value, k) for k in ClientFigures.__slots__}
        if isinstance(value, list):
            return [one(v) for v in value]
        return value

    return [{k: one(v) for k, v in run.items()} for run in runs]


def main(argv: list[str] | None = None) -> int:
    """Just this table, on one paged router + worker with the online suite's settings (its full scale,
    or --quick's); prints the table, its targets and the load average before and after."""
    import argparse

    from benchmarks.framework import targets_table
    from benchmarks.suites import online
    from kvpact.worker.loader.load import default_model_path, read_model_config

    parser = argparse.ArgumentParser(prog="python -m benchmarks.client_agreement", description=main.__doc__)
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--quick", action="store_true", help="the online suite's --quick scale")
    parser.add_argument("--concurrency", default="", help="comma-separated, instead of the scale's")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    scale = online.QUICK_CLIENT_SCALE if args.quick else online.CLIENT_SCALE
    if args.concurrency:
        try:
            levels = tuple(int(c) for c in args.concurrency.split(","))
        except ValueError:
            parser.error(f"--concurrency {args.concurrency!r}: give whole numbers, comma-separated (4,16)")
        scale = Scale(levels, scale.prompt_tokens, scale.output_tokens, scale.requests_per_slot)
    config = read_model_config(model)
    cap = min(config.max_position_embeddings, 96 if args.quick else 512)
    cluster = Cluster(model, "paged", -(-cap // 64) * 64, online.MAX_NUM_SEQS, http=True).start()
    try:
        cluster.wait_ready()
        print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        command = "python -m benchmarks.client_agreement " + " ".join(argv if argv is not None else [])
        agreement = compare(cluster, model, scale, args.seed, command.strip())
        print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    finally:
        cluster.stop()
    print(agreement.table.markdown())
    print(targets_table(agreement.targets))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
