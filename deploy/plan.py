"""`kvpact-launch --config FILE --plan`: the cluster's verdict before anything loads.

    validate the file (exit 2) -> connect to Ray -> the launch's placement group, a bundle per worker
    (ray.placement_timeout_s, then exit 1 naming the resources, as a launch does) -> a WorkerActor per
    bundle -> each runs `worker FLAGS --plan-only --json` on its node with its bundle's GPUs
    (WorkerActor.plan) -> the plans judged here as the router judges them (router --paged-attn / --policy
    through router/admission.py, router --uniform on the fingerprints) -> the verdict table -> the actors
    and the group released.

No router starts, no worker serves, no weight is read. Exit 0: every plan meets the policies and the
workers of each model name agree on the --uniform fields; 78: one does not (the table says which and
why); 1: no Ray, no placement, a lost actor, or a worker that cannot plan (e.g. its model is unreadable).
NOTE: judged in bundle order, each worker's fingerprint against the earlier workers of its model name,
as the router compares a worker with those it already holds; `judge` is pure.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpact.deploy import placement
from kvpact.deploy.cluster_file import ClusterFile, WorkerSlot
from kvpact.deploy.placement import LaunchFailure, PlacedWorker
from kvpact.deploy.worker_actor import PLAN_TIMEOUT_S
from kvpact.router.admission import admit_uniform, judge_planned_features
from kvpact.router.cli import build_parser
from kvpact.router.config import RouterConfig, resolve_policies
from kvpact.shared.errors import EXIT_FATAL, EXIT_POLICY
from kvpact.shared.features import FeatureMode, FeatureState, describe_features
from kvpact.shared.fingerprint import Fingerprint
from kvpact.shared.options import option_values

OK, REFUSED, ERROR = "ok", "refused", "error"
_PROG = "kvpact-launch"


@dataclass(frozen=True, slots=True)
class PlanRun:
    """What one worker's `--plan-only --json` gave: its exit code (None: killed after its timeout), the
    JSON object it printed (None: none), the tail of its stderr."""

    worker_id: str
    where: str
    exit_code: int | None
    document: Mapping[str, Any] | None
    stderr: str = ""


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One tensor-parallel rank's own plan on its own device (the plan's `ranks`): its verdict and what it
    would realize (`features`), or why it cannot plan (`why`)."""

    rank: int
    device: str
    verdict: str  # ok | refused | error, as the worker's --plan-only says it
    features: tuple[FeatureState, ...]
    why: str = ""


@dataclass(frozen=True, slots=True)
class Judged:
    worker_id: str
    where: str
    model_name: str
    features: tuple[FeatureState, ...]
    fingerprint: Fingerprint | None
    verdict: str  # OK, REFUSED (the router would refuse it: exit 78) or ERROR (it cannot plan: exit 1)
    reason: str = ""
    ranks: tuple[RankPlan, ...] = ()  # --tensor-parallel-size N: each rank's own plan ((): one rank)


def plan_document(stdout: str) -> dict[str, Any] | None:
    """The last line of `stdout` that is the plan's JSON object (logs may share the stream)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                document = json.loads(line)
            except ValueError:
                continue
            if isinstance(document, dict) and "verdict" in document:
                return document
    return None


def _features(document: Mapping[str, Any]) -> tuple[FeatureState, ...]:
    states = []
    for f in document.get("features") or []:
        why = f.get("reason") or {}
        states.append(
            FeatureState(
                f["name"],
                FeatureMode(f["requested"]),
                f["planned"] == "on",
                why.get("code", ""),
                why.get("message", ""),
                why.get("component", ""),
            )
        )
    return tuple(states)


def _ranks(document: Mapping[str, Any]) -> tuple[RankPlan, ...]:
    plans = []
    for r in document.get("ranks") or []:
        problem = r.get("problem") or {}
        where = (
            f"{problem['feature']}: [{problem.get('component')}] {problem.get('code')}: "
            if problem.get("feature")
            else ""
        )
        why = where + str(problem.get("message", "")) if problem else ""
        plans.append(RankPlan(int(r["rank"]), str(r["device"]), str(r["verdict"]), _features(r), why))
    return tuple(plans)


def _own_refusal(document: Mapping[str, Any], features: tuple[FeatureState, ...]) -> str:
    unmet = [
        f"it was started with --{f.name} on and plans {f.name} off because "
        f"[{f.component}] {f.code}: {f.message}"
        for f in features
        if f.requested is FeatureMode.ON and not f.realized
    ]
    return "; ".join(unmet) or str(document.get("error") or "its plan was refused (no reason given)")


def judge(
    runs: Sequence[PlanRun], policies: Mapping[str, FeatureMode], uniform: Sequence[str]
) -> list[Judged]:
    """Each worker's verdict: its own plan's, then the policies' (paged-attn's included), then --uniform's."""
    judged: list[Judged] = []
    for run in runs:
        doc = run.document
        if doc is None:
            what = "did not finish in time" if run.exit_code is None else f"exited {run.exit_code}"
            last = run.stderr.strip().splitlines()[-1:] or ["(no output)"]
            judged.append(
                Judged(run.worker_id, run.where, "", (), None, ERROR, f"its plan {what}: {last[0]}")
            )
            continue
        features = _features(doc)
        fingerprint = Fingerprint.from_json(doc["fingerprint"]) if doc.get("fingerprint") else None
        name = str(doc.get("model_name") or "")
        verdict, reason = OK, ""
        if doc.get("verdict") != OK:
            verdict = REFUSED if doc.get("exit_code") == EXIT_POLICY else ERROR
            reason = _own_refusal(doc, features) if verdict == REFUSED else str(doc.get("error") or "")
        elif (refusal := judge_planned_features(policies, features)) is not None:
            verdict, reason = REFUSED, refusal.reason
        else:
            peers = [
                (j.worker_id, j.fingerprint)
                for j in judged
                if j.model_name == name and j.fingerprint is not None
            ]
            refusal = admit_uniform(fingerprint, peers, uniform)
            if refusal is not None:
                verdict, reason = REFUSED, refusal.reason
        judged.append(
            Judged(run.worker_id, run.where, name, features, fingerprint, verdict, reason, _ranks(doc))
        )
    return judged


def verdict_code(judged: Sequence[Judged]) -> int:
    """78 when any worker would be refused; else 1 when any cannot plan; else 0."""
    if any(j.verdict == REFUSED for j in judged):
        return EXIT_POLICY
    return EXIT_FATAL if any(j.verdict == ERROR for j in judged) else 0


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip() for r in rows]


def render(judged: Sequence[Judged], uniform: Sequence[str]) -> str:
    """The verdict table: every worker's features (requested, planned, reason), each tensor-parallel
    worker's ranks (each rank's own plan on its own device), its fingerprint and whether it agrees with its
    model name's other workers (router --uniform), its verdict."""
    rows: list[tuple[str, ...]] = [("WORKER", "FEATURE", "REQUESTED", "PLANNED", "REASON")]
    for j in judged:
        for f in j.features:
            why = "" if f.realized else f"[{f.component}] {f.code}: {f.message}"
            rows.append((j.worker_id, f.name, f.requested.value, "on" if f.realized else "off", why))
    fields = ",".join(uniform) or "none"
    prints: list[tuple[str, ...]] = [
        ("WORKER", "MODEL", "AGREES", f"FINGERPRINT (router --uniform {fields})")
    ]
    for j in judged:
        mismatched = j.verdict == REFUSED and "not interchangeable" in j.reason
        agrees = "-" if j.fingerprint is None else "no" if mismatched else "yes"
        shown = j.fingerprint.describe(uniform or ()) if j.fingerprint is not None else "(none)"
        prints.append((j.worker_id, j.model_name or "?", agrees, shown))
    verdicts: list[tuple[str, ...]] = [("WORKER", "VERDICT", "WHERE / WHY")]
    verdicts += [(j.worker_id, j.verdict, j.reason or j.where) for j in judged]
    ranks: list[tuple[str, ...]] = [
        ("WORKER", "RANK", "DEVICE", "VERDICT", "ITS OWN PLAN (+ on, ! fell back, - off)")
    ]
    ranks += [
        (j.worker_id, str(r.rank), r.device, r.verdict, r.why or describe_features(r.features))
        for j in judged
        for r in j.ranks
    ]
    per_rank = ["", *_table(ranks)] if len(ranks) > 1 else []  # tensor-parallel workers only
    return "\n".join([*_table(rows), *per_rank, "", *_table(prints), "", *_table(verdicts)])


def summary(judged: Sequence[Judged]) -> str:
    code = verdict_code(judged)
    if code == 0:
        return f"plan: OK (exit code 0): all {len(judged)} workers would be admitted; no weight was loaded"
    first = next(j for j in judged if j.verdict == (REFUSED if code == EXIT_POLICY else ERROR))
    word = "REFUSED" if code == EXIT_POLICY else "FAILED"
    return f"plan: {word} (exit code {code}): worker {first.worker_id}: {first.reason}"


# --------------------------------------------------------------------------------------------- on Ray


def plan_argv(slot: WorkerSlot) -> list[str]:
    """The group's worker flags, its id, and its bundle's CPUs as --threads (as a launch gives them)."""
    argv = [*slot.group.flags, "--worker-id", slot.worker_id]
    if "--threads" not in argv:
        argv += ["--threads", str(max(1, int(slot.group.resources.get("CPU", 1))))]
    return argv


def _router_rules(cluster: ClusterFile) -> tuple[dict[str, FeatureMode], tuple[str, ...]]:
    """The router's policies (paged-attn's included) and --uniform, as its own parser reads the file."""
    values = option_values(RouterConfig, build_parser().parse_args(cluster.router_argv()))
    policy, others = resolve_policies(values["policy"], values["policies"])
    return {"paged-attn": policy, **dict(others)}, tuple(values["uniform"])


def _run_plans(placed: list[PlacedWorker]) -> list[PlanRun]:
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    refs = [(w, w.actor.plan.remote(plan_argv(w.slot), PLAN_TIMEOUT_S)) for w in placed]
    runs = []
    for worker, ref in refs:
        try:
            out = ray.get(ref, timeout=PLAN_TIMEOUT_S + 30)
        except GetTimeoutError:
            raise LaunchFailure(
                f"worker {worker.slot.worker_id}: its Ray actor in {worker.where()} did not answer `plan` "
                f"within {PLAN_TIMEOUT_S + 30:g} s (alive but stalled; see `ray status`)"
            ) from None
        except RayError as exc:
            raise LaunchFailure(placement.lost(worker, "while planning", exc)) from None
        code = out["exit_code"]
        document = plan_document(str(out["stdout"]))
        runs.append(PlanRun(worker.slot.worker_id, worker.where(), code, document, str(out["stderr"])))
    return runs


def _say(message: str, *, error: bool = False) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def run_plan(cluster: ClusterFile) -> int:
    """Place, plan, judge, print, release; the exit code. The verdict is printed last."""
    import ray

    stopping = threading.Event()
    name = f"kvpact-{uuid.uuid4().hex[:8]}"  # as a launch names its group
    group: Any = None
    placed: list[PlacedWorker] = []
    runs: list[PlanRun] = []
    failure = ""
    try:
        placement.connect(cluster.ray.address)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.set())
        _say(
            f"planning {cluster.num_workers} workers: {placement.describe_bundles(cluster)}, strategy "
            f"{cluster.ray.placement_strategy} (placement group {name}; no weight is loaded)"
        )
        group = placement.reserve(cluster, name, stopping.is_set)
        if group is not None:
            placed = [PlacedWorker(slot, placement.start_actor(slot, group)) for slot in cluster.slots()]
            if placement.locate(placed, cancelled=stopping.is_set, progress=_say):
                runs = _run_plans(placed)
    except LaunchFailure as exc:
        failure = str(exc)
    finally:
        if ray.is_initialized():
            placement.release(placed, group)
            ray.shutdown()
    if failure:
        _say(f"plan: FAILED (exit code 1): {failure}", error=True)
        return EXIT_FATAL
    if not runs:
        _say("plan: stopped before every worker had planned")
        return 0
    policies, uniform = _router_rules(cluster)
    judged = judge(runs, policies, uniform)
    print(render(judged, uniform), flush=True)
    code = verdict_code(judged)
    _say(summary(judged), error=code != 0)
    return code
