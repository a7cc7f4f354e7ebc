"""The router's configuration, read once from the command line (router/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpact.shared.intent import PagedAttentionMode


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = a free port (the bound one is logged)
    policy: PagedAttentionMode = PagedAttentionMode.AUTO
    num_expected_workers: int = 1
    startup_timeout_s: float = 300.0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    auth_token: str | None = field(default=None, repr=False)  # never logged
    metrics_port: int | None = None
    shutdown_timeout_s: float = 0.8  # bound on telling the workers to stop when the cluster fails
