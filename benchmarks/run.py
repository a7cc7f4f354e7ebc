"""Run the benchmark suites, print their tables, and write the results.

    python -m benchmarks.run [--quick] [--suites a,b] [--model PATH] [--out DIR] [--seed N]
    make bench          # the full run, results under benchmarks/results/ (committed)

Each suite (benchmarks/suites/<name>.py, see benchmarks/framework.py) writes `<out>/<name>.md`,
`.json` and `.png`; this also writes `<out>/summary.md`: every suite whose results are in `<out>`
(this run's, and earlier runs' of the suites not run now), each with its command, wall time, and its
targets with the figure measured. `--quick` is the smallest run that exercises every
path (default out: benchmarks/results/quick/, not committed). Exit code 0 when every suite ran
(targets may be missed: the report says so), 1 when a suite raised (its traceback is printed and
the other suites still run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
import traceback
from pathlib import Path

from benchmarks.framework import (
    RESULTS_DIR,
    BenchContext,
    Machine,
    Target,
    targets_table,
    write_result,
)

# In the order they run: the cheap, self-contained ones first.
SUITES = ("engine_step", "offline", "kv_memory", "paged_eager", "online", "step_budget", "router", "failfast")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the smallest run that exercises every path")
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, of {','.join(SUITES)}")
    parser.add_argument("--model", default="", help="model path (default: the bundled SmolLM2-135M GGUF)")
    parser.add_argument("--out", default="", help="results folder (default benchmarks/results[/quick])")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    names = [s for s in args.suites.split(",") if s]
    unknown = [s for s in names if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")

    # SIGTERM unwinds like Ctrl-C, so every suite's `finally` stops the processes it started.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    from kvpact.shared.log import configure_logging

    configure_logging("console", "WARNING")  # logs to stderr; tables on stdout
    if args.model:
        model = Path(args.model)
    else:
        from kvpact.worker.loader.load import default_model_path

        model = default_model_path()
    out = Path(args.out) if args.out else RESULTS_DIR / "quick" if args.quick else RESULTS_DIR
    command = "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv)
    ctx = BenchContext(
        model=model,
        quick=args.quick,
        seed=args.seed,
        out_dir=out,
        machine=Machine.detect(args.device),
        command=command.strip(),
        device=args.device,
    )
    print(f"# {ctx.command}\n# machine: {ctx.machine.line()}\n# model: {model}\n", flush=True)
    failed: list[str] = []
    for name in names:
        started = time.monotonic()
        print(f"## suite {name}", flush=True)
        try:
            result = importlib.import_module(f"benchmarks.suites.{name}").run(ctx)
        except Exception:  # noqa: BLE001 - one suite's failure must not hide the others' figures
            traceback.print_exc()
            failed.append(name)
            print(f"## suite {name}: FAILED after {time.monotonic() - started:.0f} s\n", flush=True)
            continue
        result.seconds = time.monotonic() - started
        for table in result.tables:
            print(table.markdown(), flush=True)
        if result.targets:
            print(targets_table(result.targets), flush=True)
        for path in write_result(result, ctx):
            print(f"# wrote {path}")
        print(f"## suite {name}: {result.seconds:.0f} s\n", flush=True)
    summary = _summary(ctx, failed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(summary)
    print(summary)
    return 1 if failed else 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _summary(ctx: BenchContext, failed: list[str]) -> str:
    """Every suite whose results are in ctx.out_dir (this run's and earlier runs' of the others,
    each with its own command and date), so running one suite again keeps the others' lines; then each
    GPU check's targets (gpu_*/targets.json, the Target fields read from that run's files)."""
    lines = [
        "# Benchmark summary",
        "",
        f"- model: {ctx.model.name}",
        f"- this run's machine: {ctx.machine.line()}",
        "- each suite's own machine is in its row (ratios are only compared within one suite's run)",
        "",
        "| suite | run | machine | seconds | targets met | report |",
        "|---|---|---|---:|---:|---|",
    ]
    targets: list[Target] = []
    results = [(name, ctx.out_dir / f"{name}.json", f"{name}.md") for name in SUITES]  # row, JSON, report
    for path in sorted(ctx.out_dir.glob("gpu_*/targets.json")):  # gpu_check.sh's runs, when lent a GPU
        results.append((f"gpu_check ({path.parent.name})", path, f"{path.parent.name}/README.md"))
    for name, path, report in results:
        if name in failed:
            cells = f"`{ctx.command}` | {ctx.machine.cpu} | - | FAILED | (see the run's output)"
            lines.append(f"| {name} | {cells} |")
            continue
        if not path.exists():
            continue
        saved = json.loads(path.read_text())
        saved_targets = [Target(**t) for t in saved["targets"]]
        checked = [t for t in saved_targets if t.met is not None]
        met = sum(1 for t in checked if t.met)
        lines.append(
            f"| {name} | `{saved['command']}` | {saved['machine']['cpu']} | {saved['seconds']:.0f} "
            f"| {met}/{len(checked)} | [{report}]({report}) |"
        )
        targets += saved_targets
    if targets:
        lines += ["", "## Every target", "", targets_table(targets)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
