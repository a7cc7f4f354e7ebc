"""`kvpact-launch scale --group NAME --replicas N [--address A] [--timeout S]`: resize a group of a running
kvpact cluster. Needs no cluster file: it finds the launcher through Ray (the named actor kvpact-launcher in
namespace kvpact, deploy/control.py), on a cluster node or as a job (`ray job submit -- kvpact-launch
scale ...`).

Exit codes, the verdict printed last:
    0   the group has N admitted workers, and none of its removed ones is still draining
    1   no Ray cluster or no running launcher; or N workers not admitted within --timeout (default: the
        cluster file's ray.placement_timeout_s), or the launcher gave up (a refused joiner, a placement
        never granted): says what blocked it
    2   an unknown group, or N outside the group's min_replicas..max_replicas
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvpact.deploy.control import CONTROL_NAME, CONTROL_NAMESPACE, GroupStatus

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
PROG = "kvpact-launch scale"
POLL_S = 0.5
CALL_TIMEOUT_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Change the number of workers of a group of a running kvpact cluster on Ray.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--group", required=True, metavar="NAME", help="the worker group (workers[].name)")
    parser.add_argument("--replicas", required=True, type=int, metavar="N", help="its new number of workers")
    parser.add_argument(
        "--address", metavar="A", help="the Ray cluster (default: $RAY_ADDRESS, else the local one)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S",
        help="how long to wait for N admitted workers (default: the cluster's ray.placement_timeout_s)",
    )  # fmt: skip
    return parser


def say(message: str, *, error: bool = False) -> None:
    print(f"{PROG}: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout is not None and not args.timeout > 0:
        say(f"--timeout: expected a number of seconds > 0, got {args.timeout:g}", error=True)
        return EXIT_USAGE
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        options: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING"}
        ray.init(address=address, namespace=CONTROL_NAMESPACE, **options)
    except (ConnectionError, RuntimeError) as exc:
        say(
            f"cannot connect to Ray at {address!r}: {' '.join(str(exc).split())[:300]}; pass --address or "
            "set RAY_ADDRESS",
            error=True,
        )
        return EXIT_FAILED
    try:
        return _scale(args.group, args.replicas, args.timeout, address)
    finally:
        ray.shutdown()


def _scale(group: str, num: int, timeout_s: float | None, address: str) -> int:
    import ray

    try:
        control: Any = ray.get_actor(CONTROL_NAME, namespace=CONTROL_NAMESPACE)
    except ValueError:
        say(
            f"no kvpact launcher runs on the Ray cluster at {address!r} (no actor {CONTROL_NAME!r} in "
            f"namespace {CONTROL_NAMESPACE!r}; a launcher creates it once its cluster serves); start one "
            "with `kvpact-launch --config FILE`, wait for SERVING, or pass the cluster it runs on with "
            "--address",
            error=True,
        )
        return EXIT_FAILED
    try:
        ref: Any = control.scale.remote(group, num)
        answer: dict[str, Any] = dict(ray.get(ref, timeout=CALL_TIMEOUT_S))
    except ray.exceptions.RayError as exc:
        say(f"the launcher did not answer ({type(exc).__name__}); is it stopping?", error=True)
        return EXIT_FAILED
    if "error" in answer:
        say(answer["error"], error=True)
        return EXIT_USAGE
    wait_s = timeout_s or float(answer["timeout_s"])
    say(f"group {group}: asked for {num} workers; waiting up to {wait_s:g} s for them to be admitted")
    deadline = time.monotonic() + wait_s
    status = GroupStatus(num)
    while True:
        try:
            status = GroupStatus(**ray.get(control.group_status.remote(group), timeout=CALL_TIMEOUT_S))
        except ray.exceptions.RayError as exc:
            say(f"the launcher went away while scaling ({type(exc).__name__})", error=True)
            return EXIT_FAILED
        if status.reached(num):
            say(f"group {group}: {num} admitted workers ({', '.join(status.admitted_ids)})")
            return EXIT_OK
        if status.target != num:
            why = status.gave_up or "another `scale` changed it"
            say(f"group {group}: FAILED: the launcher stays at {status.target} workers: {why}", error=True)
            return EXIT_FAILED
        if time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    leaving = f"; still leaving: {', '.join(status.leaving_ids)}" if status.leaving_ids else ""
    admitted = ", ".join(status.admitted_ids) or "none"
    blocked = status.blocked or "nothing reported (see the launcher's log)"
    say(
        f"group {group}: FAILED: {len(status.admitted_ids)} of {num} workers admitted after {wait_s:g} s "
        f"({admitted}){leaving}; blocked by: {blocked}",
        error=True,
    )
    return EXIT_FAILED
