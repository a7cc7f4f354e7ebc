"""What every benchmark suite shares: the run's context, the result shape, and how results are written.

A suite is a module `benchmarks/suites/<name>.py` with one function

    def run(ctx: BenchContext) -> SuiteResult

that measures, and returns tables (each with the command that reproduces it), the targets it checks
(measured figure, goal, met or not: a missed target is reported plainly, never hidden), raw data for
the JSON file and, optionally, a matplotlib figure. `benchmarks/run.py` calls the suites and writes
`<out>/<suite>.md`, `<suite>.json` and `<suite>.png` through `write_result`.

Suites compare ratios measured in the same run (this machine is shared and noisy); nothing here is a
timed assertion. `ctx.quick` asks for the smallest run that still exercises every code path.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Machine:
    """Where the figures were measured."""

    cpu: str
    cores: int
    torch_threads: int
    memory_gib: float
    python: str
    torch: str
    triton: str
    transformers: str
    device: str

    @classmethod
    def detect(cls, device: str = "cpu") -> Machine:
        import torch

        def version(module: str) -> str:
            try:
                return __import__(module).__version__
            except ImportError:
                return "absent"

        cpu = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        try:
            pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pages = 0
        return cls(
            cpu=cpu,
            cores=os.cpu_count() or 1,
            torch_threads=torch.get_num_threads(),
            memory_gib=round(pages / 2**30, 1),
            python=platform.python_version(),
            torch=torch.__version__,
            triton=version("triton"),
            transformers=version("transformers"),
            device=device,
        )

    def line(self) -> str:
        return (
            f"{self.cpu}, {self.cores} cores ({self.torch_threads} torch threads), {self.memory_gib} GiB, "
            f"device {self.device}; Python {self.python}, torch {self.torch}, triton {self.triton}, "
            f"transformers {self.transformers}"
        )


@dataclass(frozen=True, slots=True)
class BenchContext:
    """What a suite is asked to do. `model` is a path the kvpact loader and transformers both read
    (the bundled SmolLM2 GGUF by default, a tiny Hugging Face directory in the test); `seed` seeds
    every workload; `command` is the `benchmarks.run` command line of this run."""

    model: Path
    quick: bool
    seed: int
    out_dir: Path
    machine: Machine
    command: str
    device: str = "cpu"


@dataclass(slots=True)
class Table:
    """One printed table. `command` reproduces exactly these figures."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    command: str
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", f"`{self.command}`", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines).rstrip() + "\n"


@dataclass(slots=True)
class Target:
    """A goal from the performance issue and what this run measured. `met` is None where the run
    could not measure it (say why in `note`)."""

    name: str
    goal: str
    measured: str
    met: bool | None
    note: str = ""


@dataclass(slots=True)
class SuiteResult:
    suite: str
    tables: list[Table]
    targets: list[Target] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    figure: Any = None  # a matplotlib Figure, saved as <suite>.png
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def targets_table(targets: Sequence[Target]) -> str:
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for t in targets:
        met = "n/a" if t.met is None else "yes" if t.met else "**no**"
        note = f" ({t.note})" if t.note else ""
        lines.append(f"| {t.name} | {t.goal} | {t.measured}{note} | {met} |")
    return "\n".join(lines) + "\n"


def render_markdown(result: SuiteResult, ctx: BenchContext) -> str:
    parts = [
        f"# Benchmark: {result.suite}",
        "",
        f"- run: `{ctx.command}` ({'quick' if ctx.quick else 'full'}, seed {ctx.seed}, "
        f"{result.seconds:.0f} s)",
        f"- model: {ctx.model.name}",
        f"- machine: {ctx.machine.line()}",
        f"- measured: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]
    parts += [f"{n}" for n in result.notes]
    if result.notes:
        parts.append("")
    if result.targets:
        parts += ["## Targets", "", targets_table(result.targets)]
    if result.figure is not None:
        parts += [f"![{result.suite}]({result.suite}.png)", ""]
    for table in result.tables:
        parts.append(table.markdown())
    return "\n".join(parts)


def write_result(result: SuiteResult, ctx: BenchContext) -> list[Path]:
    """Writes <suite>.md, <suite>.json and (with a figure) <suite>.png under ctx.out_dir."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    base = ctx.out_dir / result.suite
    written = [base.with_suffix(".md"), base.with_suffix(".json")]
    if result.figure is not None:
        written.append(base.with_suffix(".png"))
        result.figure.savefig(written[-1], dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(result.figure)
    written[0].write_text(render_markdown(result, ctx))
    payload = {
        "suite": result.suite,
        "command": ctx.command,
        "quick": ctx.quick,
        "seed": ctx.seed,
        "model": ctx.model.name,
        "machine": asdict(ctx.machine),
        "seconds": result.seconds,
        "targets": [asdict(t) for t in result.targets],
        "tables": [asdict(t) for t in result.tables],
        "data": result.data,
    }
    written[1].write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return written


def shell_command(module: str, argv: Sequence[str]) -> str:
    return " ".join(["python -m", module, *map(shlex.quote, argv)])


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0) -> Any:
    """A matplotlib figure with `ncols` axes, drawn off-screen (Agg): returns (figure, axes list)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])
