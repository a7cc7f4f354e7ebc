"""`worker --plan-only [--json]`: the pre-load plan for every feature, with no router and no weight read.

It runs the same `plan_startup` a starting worker runs (the config, file sizes and headers only) and
prints what each feature will realize and why; exit 0 when the intent can be met, 78 when not, 1 when
the model cannot be read. NOTE: a failed `on` stops the real plan at that check, so the plan is made
again with that feature under `auto` (the rest of the plan as a started worker would see it had it
fallen back), and that feature is reported refused with the reason (and code) `on` met.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from typing import Any

from kvpact.shared.errors import EXIT_FATAL, EXIT_POLICY, ConfigError, FeatureRequiredError, KvpactError
from kvpact.shared.features import FeatureIntents, FeatureMode, FeatureState
from kvpact.shared.intent import cache_intent
from kvpact.shared.spec import WorkerSpec
from kvpact.worker.loader import model_name as name_of_model
from kvpact.worker.startup.device import probe_device
from kvpact.worker.startup.engine_setup import WorkerPlan, plan_startup


@dataclass(frozen=True, slots=True)
class PlanVerdict:
    exit_code: int
    features: tuple[FeatureState, ...]
    refused: tuple[FeatureState, ...]  # the features whose `on` cannot be met (their reason met under on)
    error: str = ""  # a refusal that is no feature's (ConfigError), or why the model cannot be read
    plan: WorkerPlan | None = None

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
    refused: list[FeatureState] = []
    for _ in range(len(FeatureIntents.names()) + 2):  # each round turns one failed `on` into auto
        try:
            plan = plan_startup(spec, probe=probe, log=log)
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
        features = tuple(by_name.get(f.name, f) for f in plan.features)
        return PlanVerdict(EXIT_POLICY if refused else 0, features, tuple(refused), plan=plan)
    raise AssertionError("plan-only: more failed features than features")  # each round removes one `on`


def verdict_json(v: PlanVerdict, model_name: str = "") -> dict[str, Any]:
    """`model_name`: the name it would serve under (--model-name, else the model's); the fingerprint is
    what must agree with the other workers serving that name (router --uniform); None when no plan."""
    return {
        "verdict": v.verdict,
        "exit_code": v.exit_code,
        "error": v.error or None,
        "model_name": model_name or (_default_name(v.plan) if v.plan is not None else None),
        "fingerprint": v.plan.fingerprint.to_json() if v.plan is not None else None,
        "features": [
            {
                "name": f.name,
                "requested": f.requested.value,
                "planned": "on" if f.realized else "off",
                "reason": None
                if f.realized
                else {"code": f.code, "component": f.component, "message": f.message},
            }
            for f in v.features
        ],
    }


def verdict_text(v: PlanVerdict) -> str:
    rows = [("FEATURE", "REQUESTED", "PLANNED", "REASON")]
    for f in v.features:
        why = "" if f.realized else f"[{f.component}] {f.code + ': ' if f.code else ''}{f.message}"
        rows.append((f.name, f.requested.value, "on" if f.realized else "off", why))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows]
    lines = [line.rstrip() for line in lines] if v.features else []
    if v.plan is not None:
        p = v.plan
        lines.append(f"cache: {p.cache_kind.value} on {p.probe.device}, max model len {p.max_model_len}")
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
