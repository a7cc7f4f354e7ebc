"""Interchangeable workers through real processes: two workers serving one model name with different
--max-model-len under `router --uniform max-model-len`, or a different --dtype under the default list,
fail the start (78; the one refused never reads a weight), the report naming both values; under
`--uniform model` the first two are admitted and serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpact.client import Client
from kvpact.v1 import router_pb2
from tests.factories.processes import module_argv, running, wait_for_exit, wait_for_health
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import MAX_MODEL_LEN, START_S, router_address, router_argv, worker_args
from tests.integration.test_features import loaded_weights


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=int(MAX_MODEL_LEN))


def two_workers(model: Path, address: str, *b_flags: str) -> tuple[list[str], list[str]]:
    """w-a as worker_args makes it (--max-model-len 2048, float32); w-b the same with `b_flags`."""
    a = module_argv("kvpact.worker", *worker_args(model, address, "w-a"), "--log-format", "json")
    b = module_argv("kvpact.worker", *worker_args(model, address, "w-b", *b_flags), "--log-format", "json")
    return a, b


@pytest.mark.parametrize(
    ("uniform", "b_flags", "field", "values"),
    [
        (
            ("--uniform", "model,max-model-len"),
            ("--max-model-len", "1024"),
            "max-model-len",
            ("2048", "1024"),
        ),
        ((), ("--dtype", "bfloat16"), "dtype", ("float32", "bfloat16")),  # the default list
    ],
    ids=["max-model-len", "dtype-by-default"],
)
def test_a_worker_that_differs_fails_the_start_naming_both_values(
    model, tmp_path, uniform, b_flags, field, values
):
    a_value, b_value = values
    argv = router_argv(*uniform, "--expect-workers", "2", "--failed-linger", "5")
    with running(argv, name="router", log_dir=tmp_path) as router:
        a_argv, b_argv = two_workers(model, router_address(router), *b_flags)
        with (
            running(a_argv, name="w-a", log_dir=tmp_path) as a,
            running(b_argv, name="w-b", log_dir=tmp_path) as b,
        ):
            assert wait_for_exit(router, START_S) == 78, router.output()
            codes = {h.name: wait_for_exit(h, START_S) for h in (a, b)}
    # whichever announced its plan second is refused before it loads (78); the first was pending (loading)
    # and is told to stop by the failed router (0), or, had its loop not answered while it loaded, is
    # refused when it comes back loaded (78; the router asks again while it lingers)
    outputs = (a.output(), b.output(), router.output())
    refused = [h for h in (a, b) if "refused its plan before loading" in h.stderr()]
    assert len(refused) == 1 and codes[refused[0].name] == 78, outputs
    assert not loaded_weights(refused[0]) and set(codes.values()) <= {0, 78}, outputs
    report = router.stderr()
    assert (
        f"{field} {b_value} here, {a_value} on worker 'w-a'" in report
        or f"{field} {a_value} here, {b_value} on worker 'w-b'" in report
    ), report
    assert "exit code 78: the workers serving one model name are not interchangeable" in report


@pytest.mark.slow  # two loaded workers (~40 s); tests/router/test_uniform.py admits the same with doubles
def test_the_same_two_are_admitted_under_uniform_model(model, tmp_path):
    argv = router_argv("--uniform", "model", "--expect-workers", "2")
    with running(argv, name="router", log_dir=tmp_path) as router:
        address = router_address(router)
        a_argv, b_argv = two_workers(model, address, "--max-model-len", "1024")
        with (
            running(a_argv, name="w-a", log_dir=tmp_path) as a,
            running(b_argv, name="w-b", log_dir=tmp_path) as b,
        ):
            wait_for_health(address, START_S * 2, watch=[router, a, b])
            with Client(address, timeout=30) as client:
                status = client.cluster_status()
    assert status.state == router_pb2.CLUSTER_STATE_SERVING
    lengths = sorted(w.fingerprint.max_model_len for w in status.workers)
    assert lengths == [1024, 2048]
    assert len({w.fingerprint.model for w in status.workers}) == 1
