"""`router --uniform LIST`: workers serving one model name must agree on the fingerprint's fields the list
names (default model,tokenizer,chat-template,dtype,cache-dtype). A worker that differs is refused with
both values named; while the cluster starts that fails it (78, one report); after, it is refused alone."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvpact.router.cli import build_parser, config_from_args, main
from kvpact.shared.fingerprint import UNIFORM_DEFAULT
from kvpact.v1 import router_pb2
from tests.router.doubles import (
    TINY_FINGERPRINT,
    WorkerDouble,
    loading,
    ready,
    registry_stub,
    run_async,
    running_router,
    serving_double,
)

LONGER = replace(TINY_FINGERPRINT, max_model_len=512)
OTHER_TOKENIZER = replace(TINY_FINGERPRINT, tokenizer="sha256:" + "9" * 64)


def uniform(*argv: str) -> tuple[str, ...]:
    return config_from_args(build_parser().parse_args(list(argv))).uniform


def test_the_list_replaces_the_default_and_an_unknown_name_exits_2_naming_it(capsys):
    assert uniform() == UNIFORM_DEFAULT == ("model", "tokenizer", "chat-template", "dtype", "cache-dtype")
    assert uniform("--uniform", "max-model-len,model") == ("model", "max-model-len")
    assert uniform("--uniform", "block-size", "--uniform", "tensor-parallel-size") == (
        "block-size",
        "tensor-parallel-size",
    )
    assert uniform("--uniform", "none") == ()
    with pytest.raises(SystemExit) as exit_info:
        main(["--uniform", "model,max-len"])
    assert exit_info.value.code == 2
    assert "argument --uniform: unknown name 'max-len': expected a comma list of model, tokenizer" in (
        capsys.readouterr().err
    )


@run_async
async def test_a_mismatch_while_starting_fails_the_cluster_78_with_both_values_in_one_report():
    async with (
        running_router(
            num_expected_workers=2, uniform=("model", "max-model-len"), failed_linger_s=0.3
        ) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(loading("a", a.address))).pending
        admission = await registry.Register(loading("b", b.address, fingerprint=LONGER))
        assert not admission.admitted and not admission.pending
        assert "max-model-len 512 here, 256 on worker 'a'" in admission.reason
        assert await asyncio.wait_for(router.wait(), 5.0) == 78
        report = router.report.getvalue()
    assert report.count("the cluster FAILED to start") == 1
    assert "max-model-len 512 here, 256 on worker 'a'" in report
    assert "  config:    model sha256:111111111111, max-model-len 256" in report  # worker a's
    assert "  config:    model sha256:111111111111, max-model-len 512" in report  # worker b's
    assert report.rstrip().endswith(
        "exit code 78: the workers serving one model name are not interchangeable "
        "(router --uniform model,max-model-len)"
    )


@run_async
async def test_the_same_difference_is_admitted_when_the_list_leaves_it_out_and_other_names_are_apart():
    async with (
        running_router(num_expected_workers=3, uniform=("model",)) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        serving_double(WorkerDouble("c")) as c,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(ready("a", a.address))).admitted
        assert (await registry.Register(ready("b", b.address, fingerprint=LONGER))).admitted
        other_model = replace(TINY_FINGERPRINT, model="sha256:" + "8" * 64)
        # another model name is not compared with "tiny"
        assert (
            await registry.Register(ready("c", c.address, model="other", fingerprint=other_model))
        ).admitted
        status = router.cluster.status()
    assert status.state == router_pb2.CLUSTER_STATE_SERVING
    (b_status,) = [w for w in status.workers if w.worker_id == "b"]
    assert b_status.fingerprint.max_model_len == 512  # ClusterStatus shows what it reported


@run_async
async def test_after_start_a_joiner_that_differs_is_refused_alone_and_one_without_a_fingerprint_too():
    async with (
        running_router() as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        serving_double(WorkerDouble("c")) as c,
        registry_stub(router) as registry,
    ):
        assert (await registry.Register(ready("a", a.address))).admitted
        refused = await registry.Register(ready("b", b.address, fingerprint=OTHER_TOKENIZER))
        assert not refused.admitted
        assert "tokenizer sha256:999999999999 here, sha256:222222222222 on worker 'a'" in refused.reason
        old = await registry.Register(ready("c", c.address, fingerprint=None))
        assert not old.admitted and "reported no realized-config fingerprint" in old.reason
        assert "--uniform none" in old.reason
        assert router.cluster.status().state == router_pb2.CLUSTER_STATE_SERVING
