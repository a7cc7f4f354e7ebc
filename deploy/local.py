"""`make serve`: a router and one worker on this machine, as two processes.

    python -m kvpact.deploy.local [--port 50051] [--http-port 8000] [--paged-attn auto|on|off]
                                  [--model PATH] [--startup-timeout S]

Starts `router --listen 127.0.0.1:PORT --http-listen 127.0.0.1:HTTP_PORT --expect-workers 1` (gRPC and
the OpenAI-compatible HTTP API, docs/openai.md) and a worker registering with it (the default model
unless --model), and beside them `worker --plan-only` with the worker's flags, whose table (every
feature's plan and the fingerprint, before any weight loads) is printed as soon as it is made (it takes
what the worker's own plan takes, so serving is not delayed). It waits (bounded) until the router's health
says SERVING, then prints where to send
requests, the cluster status with each worker's realized KV cache, and copy-paste client commands
(gRPC, curl and the openai SDK). Ctrl-C (or SIGTERM) stops the worker, then the router, each by pid
with a bounded wait. If either process exits on its own, the other is stopped and this exits non-zero
with the dead one's output. The ports can also come from $KVPACT_ROUTER_PORT and $KVPACT_HTTP_PORT.
Logs are written to files in a temporary directory named at start.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from kvpact.client import Client, render_cluster_status
from kvpact.deploy.processes import (
    ProcessDied,
    ProcessHandle,
    WaitCancelled,
    start_process,
    stop,
    wait_for_exit,
    wait_for_health,
)
from kvpact.shared.cli import add_paged_attn_arg
from kvpact.shared.describe import realized_table
from kvpact.shared.handshake_pb import realized_from_pb

DEFAULT_PORT = 50051
PORT_ENV = "KVPACT_ROUTER_PORT"
DEFAULT_HTTP_PORT = 8000
HTTP_PORT_ENV = "KVPACT_HTTP_PORT"
STOP_GRACE_S = 15.0
# Once one process died, how long the other may take to exit by itself (a router exits within 2 s of
# a startup-failure report, with its own exit code).
OWN_EXIT_S = 3.0
# The "Try it" request: a chat turn (an instruct model often ends a plain-text prompt at once, empty).
TRY_MESSAGES = "[{'role': 'user', 'content': 'Tell me a joke.'}]"
TRY_JSON = '{"chat": {"messages": [{"role": "user", "content": "Tell me a joke."}]}, "maxTokens": 64}'
TRY_HTTP_JSON = '{"messages": [{"role": "user", "content": "Tell me a joke."}], "max_tokens": 64}'


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvpact.deploy.local", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get(PORT_ENV, DEFAULT_PORT)),
        help=f"the router's port on 127.0.0.1 (default ${PORT_ENV}, else {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=int(os.environ.get(HTTP_PORT_ENV, DEFAULT_HTTP_PORT)),
        help=f"the OpenAI-compatible HTTP API's port on 127.0.0.1 (default ${HTTP_PORT_ENV}, else "
        f"{DEFAULT_HTTP_PORT})",
    )
    add_paged_attn_arg(parser)
    parser.add_argument(
        "--model", default="", help="HF directory or .gguf file (default: the bundled SmolLM2)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="how long to wait for the cluster to serve, in seconds (default 300)",
    )
    return parser


def commands(router: str, argv: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The router and worker command lines (this interpreter, so the venv need not be activated)."""
    router_argv = [
        sys.executable, "-m", "kvpact.router", "--listen", router, "--expect-workers", "1",
        "--paged-attn", argv.paged_attn, "--startup-timeout", f"{argv.startup_timeout:g}",
        "--http-listen", f"127.0.0.1:{argv.http_port}",
    ]  # fmt: skip
    worker_argv = [
        sys.executable, "-m", "kvpact.worker", "--router", router, "--paged-attn", argv.paged_attn,
        "--worker-id", "local-0", "--router-timeout", f"{argv.startup_timeout:g}",
    ]  # fmt: skip
    if argv.model:
        worker_argv += ["--model", argv.model]
    return router_argv, worker_argv


def plan_command(worker_argv: Sequence[str]) -> list[str]:
    """The worker's own command with --plan-only: its plan, with no router and no weight read."""
    return [*worker_argv, "--plan-only"]


def _print_plan(plan: ProcessHandle, timeout_s: float) -> None:
    """The plan's table once it is made (bounded; a plan still running then is stopped, never waited on)."""
    try:
        code = wait_for_exit(plan, timeout_s)
    except TimeoutError:
        stop(plan, grace_s=1.0)
        print(f"the worker's plan (worker --plan-only) did not finish within {timeout_s:g} s", flush=True)
        return
    table = plan.stdout().rstrip() or plan.output(400)
    print(f"the worker's plan (worker --plan-only, exit {code}; no weight loaded yet):\n{table}", flush=True)


def describe(router: str, http: str, processes: Sequence[ProcessHandle], log_dir: str) -> str:
    with Client(router, timeout=10) as client:
        status = client.cluster_status()
    tables = [
        realized_table(realized_from_pb(w.realized), title=f"worker {w.worker_id}: realized KV cache")
        for w in status.workers
        if w.HasField("realized")
    ]
    pids = ", ".join(f"{p.name} pid {p.pid}" for p in processes)
    model = next((w.model_name for w in status.workers), "")
    return "\n\n".join(
        [
            f"kvpact is serving on {router} (gRPC) and http://{http}/v1 (OpenAI API) ({pids}; logs in "
            f"{log_dir})",
            render_cluster_status(status),
            *tables,
            "Try it:\n"
            f'  {_python()} -c "from kvpact.client import Client; '
            f"print(Client('{router}').chat({TRY_MESSAGES}, max_tokens=64).text)\"\n"
            f"  grpcurl -plaintext -d '{TRY_JSON}' "
            f"{router} kvpact.v1.Generation/Generate\n"
            f"  curl -s http://{http}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", {TRY_HTTP_JSON[1:]}\'\n'
            f'  {_python()} -c "from openai import OpenAI; '
            f"c = OpenAI(base_url='http://{http}/v1', api_key='none'); "
            f"print(c.chat.completions.create(model='{model}', messages={TRY_MESSAGES}, max_tokens=64)"
            '.choices[0].message.content)"',
            "Ctrl-C stops both.",
        ]
    )


def _python() -> str:
    """This interpreter as the user would type it (.venv/bin/python from the repository)."""
    relative = os.path.relpath(sys.executable)
    return relative if not relative.startswith("..") else sys.executable


def _watch(handle: ProcessHandle, done: threading.Event) -> None:
    handle.popen.wait()
    done.set()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    router = f"127.0.0.1:{args.port}"
    log_dir = tempfile.mkdtemp(prefix="kvpact-serve-")
    router_argv, worker_argv = commands(router, args)

    done = threading.Event()  # a signal arrived or a process exited
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())

    print(f"starting a router on {router} and one worker (--paged-attn {args.paged_attn}); logs in {log_dir}")
    plan = start_process(plan_command(worker_argv), name="plan", log_dir=log_dir)
    processes = [start_process(router_argv, name="router", log_dir=log_dir)]
    processes.append(start_process(worker_argv, name="worker", log_dir=log_dir))
    for handle in processes:
        threading.Thread(target=_watch, args=(handle, done), daemon=True).start()
    failure = ""
    try:
        _print_plan(plan, args.startup_timeout)
        wait_for_health(router, args.startup_timeout, watch=processes, cancel=done)
        print(describe(router, f"127.0.0.1:{args.http_port}", processes, log_dir), flush=True)
        done.wait()
    except (ProcessDied, WaitCancelled):
        pass  # a process died (reported below, with its output) or a signal arrived
    except TimeoutError as exc:
        failure = str(exc)
    finally:
        if any(p.returncode is not None for p in processes):
            _let_exit(processes, OWN_EXIT_S)  # e.g. the router exits 1/78 right after the worker's failure
        dead = [p for p in processes if p.returncode is not None]
        stop(plan, grace_s=1.0)  # exited already, unless a signal cut its wait short
        _stop_all(processes)
    if failure:
        print(f"kvpact.deploy.local: {failure}", file=sys.stderr)
        _report(processes)
        return 1
    if not dead:
        print("stopped")
        return 0
    failed = [
        p for p in processes if p in dead or p.returncode != 0
    ]  # the one that died, and any it took along
    _report(failed)
    return next((code for code in (p.returncode for p in dead) if code and code > 0), 1)


def _let_exit(processes: Sequence[ProcessHandle], timeout_s: float) -> None:
    """Wait up to `timeout_s` for every process to exit on its own."""
    deadline = time.monotonic() + timeout_s
    while any(p.returncode is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop_all(processes: Sequence[ProcessHandle]) -> None:
    """The worker first (it would only log a lost router otherwise), then the router."""
    for handle in reversed(processes):
        stop(handle, grace_s=STOP_GRACE_S)


def _report(processes: Sequence[ProcessHandle]) -> None:
    for handle in processes:
        print(f"{handle.name} exited with code {handle.returncode}\n{handle.output()}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
