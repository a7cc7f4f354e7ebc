"""benchmarks/engine_throughput.py: a failed request ends the measurement instead of hanging it."""

from __future__ import annotations

import re
import threading

from benchmarks.engine_throughput import measure
from kvpact.shared.handshake import WorkerLoad
from kvpact.worker.request import GenerationError


class FailingEngine:
    """Fails every request from another thread, as the engine's step thread does."""

    vocab_size = 100

    def stats(self) -> WorkerLoad:
        return WorkerLoad()

    def submit(self, request, sink) -> None:  # type: ignore[no-untyped-def]
        threading.Thread(target=sink, args=(GenerationError("simulated device fault"),)).start()


class SilentEngine(FailingEngine):
    """Accepts requests and never answers."""

    def submit(self, request, sink) -> None:  # type: ignore[no-untyped-def]
        pass


def measured(engine, **kwargs) -> BaseException | None:  # type: ignore[no-untyped-def]
    """Run `measure` in a thread bounded by a join timeout; what it raised (None if it returned)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            measure(engine, 2, 4, 4, "t", **kwargs)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert outcome, "measure() is still waiting"
    return outcome[0]


def test_a_failed_request_ends_the_measurement_naming_it():
    error = measured(FailingEngine())
    assert isinstance(error, SystemExit)
    assert re.fullmatch(r"request t-[01] failed: simulated device fault", str(error)), str(error)


def test_requests_that_never_finish_time_out():
    error = measured(SilentEngine(), timeout_s=0.2)
    assert isinstance(error, TimeoutError)
    assert str(error) == "t: 2 requests did not finish within 0.2 s"
