"""`worker --plan-only [--json]`: the pre-load plan for every feature, with no router and no weight read.

It runs the same `plan_startup` a starting worker runs (the config, file sizes and headers only) and
prints what each feature will realize and why; exit 0 when the intent can be met, 78 when not, 1 when
the model cannot be read. NOTE: a failed `on` stops the real plan at that check, so the plan is made
again with that feature under `auto` (the rest of the plan as a started worker would see it had it
fallen back), and that feature is reported refused with the reason (and code) `on` met.

With --tensor-parallel-size N every rank is planned, in this process and on its own device (rank r's
verdict is what its follower would send: follower.own_verdict), and the worker's plan is decided from
all of them as a started rank 0 decides it (checks.every_rank): each rank's own plan and the combined one
are reported. The model's header is read once for all of them (loader/header.py). No rank is spawned.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from kvpact.shared.errors import EXIT_FATAL, EXIT_POLICY, ConfigError, FeatureRequiredError, KvpactError
from kvpact.shared.features import FeatureIntents, FeatureMode, FeatureState, describe_features
from kvpact.shared.intent import cache_intent
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.loader import model_name as name_of_model
from kvpact.worker.loader.header import read_model_header
from kvpact.worker.parallel.rank_verdict import RankVerdict
from kvpact.worker.startup.device import probe_device
from kvpact.worker.startup.engine_setup import WorkerPlan, plan_startup, rank_devices
from kvpact.worker.startup.follower import own_verdict

_QUIET = structlog.ReturnLogger()  # the ranks' own plans: the combined plan logs what the worker would


@dataclass(frozen=True, slots=True)
class PlanVerdict:
    exit_code: int
    features: tuple[FeatureState, ...]
    refused: tuple[FeatureState, ...]  # the features whose `on` cannot be met (their reason met under on)
    error: str = ""  # a refusal that is no feature's (ConfigError), or why the model cannot be read
    plan: WorkerPlan | None = None
    # tensor parallel: each rank's own plan on its own device, rank 0 first (() for one rank)
    ranks: tuple[RankVerdict, ...] = ()
    tensor_parallel_size: int = 1

    @property
    def verdict(self) -> str:
        return "ok" if self.exit_code == 0 else "refused"


def _as_auto(spec: WorkerSpec, feature: str) -> WorkerSpec:
    if feature == "paged-attn":
        return replace(spec, cache=cache_intent(FeatureMode.AUTO, spec.cache.paged))
    field = feature.replace("-", "_")
    return replace(spec, features=replace(spec.features, **{field: FeatureMode.AUTO}))


def make_plan(spec: WorkerSpec, log: Any = None) -> PlanVerdict:
    probe = probe_device(spec.device, spec.device_map)
    size = spec.tensor_parallel_size
    try:
        header = read_model_header(spec.model or None)
    except KvpactError as exc:
        return PlanVerdict(EXIT_FATAL, (), (), str(exc), tensor_parallel_size=size)
    if size == 1:
        return _settle(spec, lambda s: plan_startup(s, probe=probe, log=log, header=header))
    devices = rank_devices(probe.device, size)

    def others(s: WorkerSpec) -> tuple[RankVerdict, ...]:  # ranks 1..N-1's verdicts, as they would send
        return tuple(own_verdict(r, replace(s, device=devices[r]), header, _QUIET) for r in range(1, size))

    asked = others(spec)  # under the operator's flags: reported, and the first round's (each is a plan)
    combined = _settle(
        spec,
        lambda s: plan_startup(
            s, probe=probe, log=log, header=header, rank_verdicts=asked if s is spec else others(s)
        ),
    )
    own = (own_verdict(0, spec, header, _QUIET, probe), *asked)
    return replace(combined, ranks=own, tensor_parallel_size=size)


def _settle(spec: WorkerSpec, plan: Callable[[WorkerSpec], WorkerPlan]) -> PlanVerdict:
    """`plan(spec)`, each failed `on` reported refused and planned again under auto."""
    refused: list[FeatureState] = []
    for _ in range(len(FeatureIntents.names()) + 2):  # each round turns one failed `on` into auto
        try:
            made = plan(spec)
        except FeatureRequiredError as exc:
            refused.append(
                FeatureState(exc.feature, FeatureMode.ON, False, exc.code, exc.reason, exc.component)
            )
            spec = _as_auto(spec, exc.feature)
            continue
        except ConfigError as exc:
            return PlanVerdict(EXIT_POLICY, (), tuple(refused), str(exc))
        except KvpactError as exc:
            return PlanVerdict(EXIT_FATAL, (), tuple(refused), str(exc))
        by_name = {r.name: r for r in refused}
        features = tuple(by_name.get(f.name, f) for f in made.features)
        return PlanVerdict(EXIT_POLICY if refused else 0, features, tuple(refused), plan=made)
    raise AssertionError("plan-only: more failed features than features")  # each round removes one `on`


def _features_json(features: tuple[FeatureState, ...]) -> list[dict[str, Any]]:
    return [
        {
            "name": f.name,
            "requested": f.requested.value,
            "planned": "on" if f.realized else "off",
            "reason": None
            if f.realized
            else {"code": f.code, "component": f.component, "message": f.message},
        }
        for f in features
    ]


def rank_word(v: RankVerdict) -> str:
    """A rank's own verdict: ok, refused (an `on` it cannot meet, or a bad flag: 78) or error (1)."""
    if v.problem is None:
        return "ok"
    return "refused" if v.problem.kind in ("required", "config") else "error"


def _rank_json(v: RankVerdict) -> dict[str, Any]:
    p = v.problem
    problem = None
    if p is not None:
        problem = {"kind": p.kind, "feature": p.feature or None, "code": p.code or None,
                   "component": p.component or None, "message": p.message}  # fmt: skip
    return {
        "rank": v.rank,
        "device": v.device,
        "verdict": rank_word(v),
        "features": _features_json(v.features),
        "problem": problem,
    }


def verdict_json(v: PlanVerdict, model_name: str = "") -> dict[str, Any]:
    """`model_name`: the name it would serve under (--model-name, else the model's); the fingerprint is
    what must agree with the other workers serving that name (router --uniform); None when no plan.
    `ranks`: with --tensor-parallel-size N, each rank's own plan on its own device ([] for one rank);
    `verdict`, `features` and the fingerprint are the worker's, decided from all of them."""
    return {
        "verdict": v.verdict,
        "exit_code": v.exit_code,
        "error": v.error or None,
        "model_name": model_name or (_default_name(v.plan) if v.plan is not None else None),
        "fingerprint": v.plan.fingerprint.to_json() if v.plan is not None else None,
        "features": _features_json(v.features),
        "tensor_parallel_size": v.tensor_parallel_size,
        "ranks": [_rank_json(r) for r in v.ranks],
    }


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip() for r in rows]


def _rank_cell(v: RankVerdict) -> str:
    if v.problem is None:
        return describe_features(v.features)
    p = v.problem
    where = f"{p.feature}: [{p.component}] {p.code + ': ' if p.code else ''}" if p.feature else ""
    return where + p.message


def verdict_text(v: PlanVerdict) -> str:
    rows = [("FEATURE", "REQUESTED", "PLANNED", "REASON")]
    for f in v.features:
        why = "" if f.realized else f"[{f.component}] {f.code + ': ' if f.code else ''}{f.message}"
        rows.append((f.name, f.requested.value, "on" if f.realized else "off", why))
    lines = _columns(rows) if v.features else []
    if v.ranks:
        lines.append("")
        lines += _columns(
            [("RANK", "DEVICE", "VERDICT", "ITS OWN PLAN (+ on, ! fell back, - off)")]
            + [(str(r.rank), r.device, rank_word(r), _rank_cell(r)) for r in v.ranks]
        )
        lines.append(
            f"ranks: {len(v.ranks)}; the worker's plan above is decided from every rank's (each feature "
            f"alike on every rank)"
        )
    if v.plan is not None:
        p = v.plan
        lines.append(f"cache: {p.kind.value} on {p.probe.device}, max model len {p.max_model_len}")
        lines.append(f"fingerprint: {p.fingerprint.describe()}")
    if v.error:
        lines.append(f"error: {v.error}")
    lines.append(f"verdict: {v.verdict} (exit {v.exit_code})")
    return "\n".join(lines)


def _default_name(plan: WorkerPlan) -> str:
    return name_of_model(plan.model_path)


def run_plan_only(spec: WorkerSpec, as_json: bool, model_name: str | None = None) -> int:
    """Print the plan (stdout) and return the exit code; logs go to stderr. `model_name`: --model-name."""
    v = make_plan(spec)
    out = json.dumps(verdict_json(v, model_name or "")) if as_json else verdict_text(v)
    print(out, file=sys.stdout, flush=True)
    return v.exit_code
