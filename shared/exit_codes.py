"""The exit codes of `router` and `worker`, in one table: both CLIs' --help, their docstrings' readers and
the docs (README.md, docs/contract.md, between `exit-codes` markers) are rendered from `EXIT_CODES`
(`python tools/render_docs.py` rewrites the docs; tests/test_docs.py fails when they drift)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Literal

from kvpact.shared.errors import EXIT_FATAL, EXIT_POLICY

EXIT_OK = 0
EXIT_USAGE = 2  # argparse's own code for bad flags

Process = Literal["router", "worker"]


@dataclass(frozen=True, slots=True)
class ExitCode:
    code: int
    router: str
    worker: str

    def meaning(self, process: Process) -> str:
        return self.router if process == "router" else self.worker


EXIT_CODES = (
    ExitCode(
        EXIT_OK,
        router="stopped by SIGINT/SIGTERM (after draining, up to --drain-timeout)",
        worker="stopped on request (SIGINT/SIGTERM, after draining up to --drain-timeout; or the router "
        "asked it to stop)",
    ),
    ExitCode(
        EXIT_FATAL,
        router="startup timeout (names who is missing), a port in use (--listen, --metrics-port), "
        "other startup failure",
        worker="model failed to load, a port in use (--listen, --metrics-port), router unreachable for "
        "--router-timeout (before loading, if it never acknowledged the plan), auth token rejected, TLS "
        "handshake with the router failed or its certificate refused, its --worker-id held by a live "
        "worker, an internal (engine) failure",
    ),
    ExitCode(
        EXIT_USAGE,
        router="bad flags (an unreadable TLS, token or API key file included)",
        worker="bad flags (an unreadable TLS file included)",
    ),
    ExitCode(
        EXIT_POLICY,
        router="a worker cannot honor a feature policy (--paged-attn, --policy), or is not interchangeable "
        "with the workers serving its model name (--uniform), while the cluster starts "
        "(one report names each worker, what it was asked, what it realized or planned, and why)",
        worker="configuration cannot be honored: a --FEATURE on (--paged-attn, --prefix-caching, "
        "--cpu-kernels, --cuda-graphs) not realizable here, flags that "
        "contradict the device or model, or the router refused it (its plan, before loading, or the "
        "ready worker)",
    ),
)


def exit_codes_help(process: Process, width: int = 100) -> str:
    """The `Exit codes:` section of `router --help` / `worker --help` (for RawDescriptionHelpFormatter)."""
    lines = ["Exit codes:"]
    for entry in EXIT_CODES:
        lines += textwrap.wrap(
            entry.meaning(process), width, initial_indent=f"  {entry.code:<4}", subsequent_indent=" " * 6
        )
    return "\n".join(lines)


def exit_codes_markdown() -> str:
    """The table in README.md and docs/contract.md."""
    rows = ["| code | router | worker |", "|---|---|---|"]
    rows += [f"| {e.code} | {e.router} | {e.worker} |" for e in EXIT_CODES]
    return "\n".join(rows)
