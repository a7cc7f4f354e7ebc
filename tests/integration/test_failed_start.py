"""No worker left behind after a failed start (issue 11, item 4), with real processes.

The router (`--paged-attn on --expect-workers 2`), worker a (`on`) and worker b (`on --pa-backend triton`,
impossible on CPU) are started together. b fails its pre-load checks and reports it; the cluster fails.
Whether a announced its plan before or after that, it is told: before, the router asks it to stop; after,
the router, lingering in FAILED until every expected worker was told, refuses its plan. Every worker
exits within 10 s of the router, and none loads weights after it was told not to. Repeated, since the
order of events varies from run to run (2 repetitions by default, 10 under the slow marker).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.factories.processes import ProcessHandle, free_port, module_argv, running
from tests.factories.tiny_models import make_tiny_llama
from tests.integration.test_cluster import MAX_MODEL_LEN, START_S, log_events


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=int(MAX_MODEL_LEN))


def exit_times(handles: list[ProcessHandle], timeout_s: float) -> dict[str, float]:
    """Poll until every process exited; the monotonic time each was first seen exited."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(handles):
        for h in handles:
            if h.name not in seen and h.returncode is not None:
                seen[h.name] = time.monotonic()
        assert time.monotonic() < deadline, {h.name: h.returncode for h in handles}
        time.sleep(0.02)
    return seen


@pytest.mark.parametrize(
    "repetitions", [pytest.param(2, id="2x"), pytest.param(10, id="10x", marks=pytest.mark.slow)]
)
def test_a_failed_start_reaches_every_worker_started_with_it(model: Path, tmp_path: Path, repetitions: int):
    lags = []
    for rep in range(repetitions):
        log_dir = tmp_path / f"rep{rep}"
        log_dir.mkdir()
        address = f"127.0.0.1:{free_port()}"
        router = module_argv("kvpact.router", "--listen", address, "--log-format", "json", "--paged-attn",
                             "on", "--expect-workers", "2", "--startup-timeout", "120")  # fmt: skip
        common = ["--model", str(model), "--model-name", "tiny", "--router", address,
                  "--router-timeout", "30", "--max-model-len", MAX_MODEL_LEN, "--paged-attn", "on",
                  "--log-format", "json"]  # fmt: skip
        a = module_argv("kvpact.worker", *common, "--worker-id", "a")
        b = module_argv("kvpact.worker", *common, "--worker-id", "b", "--pa-backend", "triton")
        with (
            running(router, name="router", log_dir=log_dir) as r,
            running(a, name="a", log_dir=log_dir) as wa,
            running(b, name="b", log_dir=log_dir) as wb,
        ):
            exited = exit_times([r, wa, wb], START_S)
            codes = {h.name: h.returncode for h in (r, wa, wb)}
        assert codes["router"] == 78 and codes["b"] == 78 and codes["a"] in (0, 78), (codes, wa.output())
        lag = {w: round(exited[w] - exited["router"], 2) for w in ("a", "b")}
        lags.append(lag)
        assert all(v < 10 for v in lag.values()), lag
        told_not_to_load = log_events(wa, "plan refused")
        assert not (told_not_to_load and log_events(wa, "model_loaded")), wa.output()
    print(f"failed start x{repetitions}: worker exit minus router exit (s): {lags}")
