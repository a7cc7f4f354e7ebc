"""worker.engine.accelerator: the step loop's helpers for an accelerator, checked on the CPU."""

from __future__ import annotations

import threading

import torch

from kvpact.worker.engine import step_loop
from kvpact.worker.engine.accelerator import bind_thread, to_device


def test_bind_thread_sets_the_current_cuda_device_and_nothing_else(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    bind_thread(torch.device("cpu"))
    bind_thread(torch.device("mps"))
    bind_thread(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_to_device_on_the_cpu_keeps_values_and_dtype():
    host = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    moved = to_device(host, torch.device("cpu"))
    assert moved.dtype is torch.int32 and moved.tolist() == [[3, 1], [2, 0]]


def test_to_device_on_cuda_copies_through_pinned_memory_without_blocking(monkeypatch):
    """Described: the copy must not be PyTorch's blocking host-to-device copy (a stream sync)."""
    copies = []

    class Host:
        def pin_memory(self):  # type: ignore[no-untyped-def]
            copies.append("pinned")
            return self

        def to(self, device, non_blocking=False):  # type: ignore[no-untyped-def]
            copies.append((device, non_blocking))
            return "on the device"

    assert to_device(Host(), torch.device("cuda", 0)) == "on the device"  # type: ignore[arg-type]
    assert copies == ["pinned", (torch.device("cuda", 0), True)]


def test_the_engine_binds_its_step_thread_to_the_runner_device(make_engine, tiny_llama, monkeypatch):
    bound = []
    monkeypatch.setattr(
        step_loop, "bind_thread", lambda d: bound.append((d, threading.current_thread().name))
    )
    engine = make_engine(tiny_llama, "on", context_tokens=1024)
    engine.close()
    assert bound == [(torch.device("cpu"), "kvpact-engine")]
