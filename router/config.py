"""The router's configuration, read once from the command line (router/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpact.shared.intent import PagedAttentionMode
from kvpact.shared.tls import TlsConfig


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = a free port (the bound one is logged)
    policy: PagedAttentionMode = PagedAttentionMode.AUTO
    num_expected_workers: int = 1
    startup_timeout_s: float = 300.0
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)  # never logged; re-read on SIGHUP
    auth_token_file: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never logged; re-read on SIGHUP
    api_key_file: str | None = None
    tls: TlsConfig | None = None  # None = plaintext (loopback)
    metrics_port: int | None = None
    balance: str = "least-load"  # a name in router/balancing POLICIES (--balance)
    shutdown_timeout_s: float = 0.8  # bound on telling the workers to stop when the cluster fails
    # After a failed start the router stays up this long at most, refusing every handshake (a plan
    # included) and heartbeat with the failure, so a worker that starts meanwhile is told before it loads;
    # it exits sooner once every expected worker has been told.
    failed_linger_s: float = 15.0
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight calls get this long to finish
    report_file: str | None = None  # --report-file: router/report_file.py
    max_in_flight_per_worker: int = 512  # requests forwarded to one worker at once, then RESOURCE_EXHAUSTED
