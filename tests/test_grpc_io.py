"""shared/grpc_io.py: the router's and the worker's entry points choose gRPC's I/O before grpc loads."""

from __future__ import annotations

import subprocess
import sys

from kvpact.shared.grpc_io import EXPERIMENTS, set_grpc_io


def test_the_event_engine_client_and_listener_are_off_unless_the_operator_chose():
    env: dict[str, str] = {}
    set_grpc_io(env)
    assert env == {"GRPC_EXPERIMENTS": EXPERIMENTS}
    assert EXPERIMENTS == "-event_engine_client,-event_engine_listener"
    chosen = {"GRPC_EXPERIMENTS": "event_engine_callback_cq"}
    env = dict(chosen)
    set_grpc_io(env)
    assert env == chosen


def test_the_entry_points_set_it_before_anything_imports_grpc():
    # gRPC reads GRPC_EXPERIMENTS once, when it loads: an entry point module that imported grpc (or
    # anything that does) before its main() ran would make the setting a no-op.
    code = (
        "import sys, kvpact.router.__main__, kvpact.worker.__main__; "
        "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
