"""structlog setup shared by router and worker.

One list of processors serves structlog and the stdlib/foreign loggers (grpc, ray), so every line has
the same shape: Ray's logger, which keeps its own handler and does not propagate, is brought back to
the root handler (when Ray was imported before configure_logging; gRPC's C core writes to stderr on its
own and stays as it is).

Format: the `--log-format` argument wins, then KVPACT_LOG_FORMAT, then JSON lines when stderr is not a
TTY and a readable console otherwise. Bind request/worker ids with
`structlog.contextvars.bound_contextvars(request_id=...)` for a request's scope.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, Literal

import structlog

LogFormat = Literal["auto", "json", "console"]
LOG_FORMATS = ("auto", "json", "console")
# Libraries that install their own handler and stop propagation (Ray, once imported): their lines are
# brought back to the root handler, so they come out in the same format.
FOREIGN_LOGGERS = ("ray", "grpc")


def resolve_format(
    requested: str = "auto", environ: dict[str, str] | None = None, isatty: bool | None = None
) -> str:
    env = os.environ if environ is None else environ
    if requested != "auto":
        return requested
    from_env = env.get("KVPACT_LOG_FORMAT", "auto")
    if from_env in ("json", "console"):
        return from_env
    tty = sys.stderr.isatty() if isatty is None else isatty
    return "console" if tty else "json"


class _AddFields:
    """A processor that adds fixed fields (e.g. the process's worker_id) unless a line sets its own."""

    def __init__(self, fields: Mapping[str, str]) -> None:
        self._fields = dict(fields)

    def __call__(
        self, logger: Any, method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        for key, value in self._fields.items():
            event_dict.setdefault(key, value)
        return event_dict


def configure_logging(
    log_format: str = "auto", level: str = "INFO", fields: Mapping[str, str] | None = None
) -> str:
    """Configure structlog and the stdlib root logger to write to stderr. Returns the format used.
    `fields` go into every line, foreign ones too (a worker passes its worker_id, so lines logged from its
    engine thread, gRPC's and Ray's Python loggers carry it like its request-scoped lines)."""
    fmt = resolve_format(log_format)
    shared_processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        _AddFields(fields or {}),
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared_processors.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        # A line under the level is dropped before any processor runs (merging the context, the time
        # stamp): the router's per-request debug line cost ~7.5 us when filtered only at the handler.
        processors=[
            structlog.stdlib.filter_by_level,
            *shared_processors,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared_processors,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in FOREIGN_LOGGERS:
        foreign = logging.getLogger(name)
        foreign.handlers[:] = []
        foreign.propagate = True
    return fmt
