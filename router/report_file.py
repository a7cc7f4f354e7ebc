"""`router --report-file PATH`: what the router says about itself, for the program that started it.

One JSON object, replaced whole (written beside PATH, then renamed over it) at each change of state (bound,
serving, failed, stopping) and, while serving, at each change of a worker's (joined, draining, left, dead,
revived: kvpact-launch scale counts a group's admitted workers from it) and at every heartbeat check (half
the heartbeat interval: the workers' loads, which kvpact-launch's autoscaling reads), so a reader never
sees half of one. `cluster_status` is the snapshot taken at that change; ask ClusterStatus for the live one.

    {"address": "HOST:PORT",            # where it listens (the bound port when --listen asked for 0)
     "http_address": "" | "HOST:PORT",  # the OpenAI-compatible front (--http-listen), "" when off
     "state": "starting" | "serving" | "failed" | "stopping",
     "exit_code": null | N,             # set once the router knows how it will exit
     "cause": "",                       # why it failed (the report's cause line)
     "report": "",                      # the failure report (router/report.py), as printed
     "cluster_status": {...}}           # ClusterStatusResponse in protobuf's JSON mapping

kvpact-launch reads it instead of parsing the router's output or dialing it back (deploy/launch.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kvpact.v1 import router_pb2


def write_report(
    path: str,
    *,
    address: str,
    http_address: str = "",
    state: str,
    status: router_pb2.ClusterStatusResponse,
    exit_code: int | None = None,
    cause: str = "",
    report: str = "",
) -> None:
    document: dict[str, Any] = {
        "address": address,
        "http_address": http_address,
        "state": state,
        "exit_code": exit_code,
        "cause": cause,
        "report": report,
        "cluster_status": json_format.MessageToDict(status),
    }
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(document) + "\n")
    os.replace(partial, target)
