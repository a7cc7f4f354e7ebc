"""deploy/plan.py's judgment, without Ray: real `worker --plan-only --json` objects (in-process, from the
tiny model) judged as the router would, and the exit code each verdict gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpact.deploy.plan import (
    ERROR,
    OK,
    REFUSED,
    PlanRun,
    judge,
    plan_document,
    render,
    summary,
    verdict_code,
)
from kvpact.shared.features import FeatureMode
from kvpact.worker.cli import parse_args
from kvpact.worker.plan_only import make_plan, verdict_json
from tests.factories.tiny_models import make_tiny_llama

AUTO, ON, OFF = FeatureMode.AUTO, FeatureMode.ON, FeatureMode.OFF
ALL_AUTO = dict.fromkeys(
    ("paged-attn", "prefix-caching", "cpu-kernels", "quant-kernels", "cuda-graphs"), AUTO
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=256)


def planned(model: Path, worker_id: str, *flags: str) -> PlanRun:
    options = parse_args(["--model", str(model), "--model-name", "tiny", "--max-model-len", "256", *flags])
    document: dict[str, Any] = verdict_json(make_plan(options.spec), "tiny")
    stdout = '{"event": "a log line"}\n' + json.dumps(document) + "\n"  # logs may share the stream
    return PlanRun(worker_id, f"bundle of {worker_id}", document["exit_code"], plan_document(stdout))


def test_agreeing_plans_are_ok_and_exit_0(model):
    runs = [planned(model, "a-0", "--paged-attn", "on"), planned(model, "a-1", "--paged-attn", "on")]
    judged = judge(runs, {**ALL_AUTO, "paged-attn": ON}, ("model", "max-model-len"))
    assert [j.verdict for j in judged] == [OK, OK] and verdict_code(judged) == 0
    assert summary(judged).startswith("plan: OK (exit code 0): all 2 workers would be admitted")
    table = render(judged, ("model", "max-model-len"))
    assert "WORKER  MODEL  AGREES  FINGERPRINT (router --uniform model,max-model-len)" in table


def test_a_policy_a_workers_own_on_and_uniform_each_refuse_with_78(model):
    runs = [
        planned(model, "a-0"),  # auto: the eager cache on CPU
        planned(model, "b-0", "--cuda-graphs", "on"),  # its own on cannot be met
        planned(model, "c-0", "--max-model-len", "128"),  # another max-model-len
    ]
    judged = judge(runs, ALL_AUTO, ("max-model-len",))
    assert [j.verdict for j in judged] == [OK, REFUSED, REFUSED]
    assert judged[1].reason.startswith("it was started with --cuda-graphs on and plans cuda-graphs off")
    assert "max-model-len 128 here, 256 on worker 'a-0'" in judged[2].reason
    assert verdict_code(judged) == 78
    policy = judge(runs[:1], {**ALL_AUTO, "prefix-caching": ON}, ())
    assert policy[0].verdict == REFUSED
    assert (
        "the cluster policy is --policy prefix-caching=on and it plans prefix-caching off" in policy[0].reason
    )


def test_a_worker_that_printed_no_plan_is_an_error_and_exits_1():
    crashed = PlanRun(
        "x-0", "bundle 0", 1, None, "Traceback ...\nModuleNotFoundError: No module named 'kvpact'\n"
    )
    judged = judge([crashed], ALL_AUTO, ())
    assert judged[0].verdict == ERROR and verdict_code(judged) == 1
    assert judged[0].reason == "its plan exited 1: ModuleNotFoundError: No module named 'kvpact'"
    late = judge([PlanRun("x-0", "bundle 0", None, None, "")], ALL_AUTO, ())
    assert late[0].reason == "its plan did not finish in time: (no output)"


def test_a_tensor_parallel_workers_ranks_are_shown_each_with_its_own_plan(model):
    tp = planned(model, "tp-0", "--tensor-parallel-size", "2", "--paged-attn", "on")
    runs = [tp, planned(model, "a-0")]
    judged = judge(runs, ALL_AUTO, ())
    assert [j.verdict for j in judged] == [OK, OK]
    assert [(r.rank, r.device, r.verdict) for r in judged[0].ranks] == [(0, "cpu", "ok"), (1, "cpu", "ok")]
    assert judged[1].ranks == ()  # one rank: no rank rows
    table = render(judged, ())
    assert "WORKER  RANK  DEVICE  VERDICT  ITS OWN PLAN (+ on, ! fell back, - off)" in table
    assert (
        "tp-0    0     cpu     ok       +paged-attn +prefix-caching +cpu-kernels !quant-kernels !cuda-graphs"
        in table
    )
    assert (
        "tp-0    1     cpu     ok       +paged-attn +prefix-caching +cpu-kernels !quant-kernels !cuda-graphs"
        in table
    )
    assert "a-0     0" not in table


def test_a_rank_that_refuses_on_refuses_its_worker_and_its_row_says_why(model):
    flags = ("--tensor-parallel-size", "2", "--paged-attn", "on", "--pa-context-tokens", "100")
    (judged,) = judge([planned(model, "tp-0", *flags)], ALL_AUTO, ())
    assert judged.verdict == REFUSED
    assert "rank 0 (cpu) cannot realize it: the KV cache budget (--pa-context-tokens 100)" in judged.reason
    assert [(r.rank, r.verdict) for r in judged.ranks] == [(0, "refused"), (1, "refused")]
    assert judged.ranks[1].why.startswith("paged-attn: [cache-budget] kv-budget: the KV cache budget")
