"""Probe the device and build a worker runs on, before anything is loaded.

`probe_device` resolves `--device` (auto: CUDA if available, else MPS, else CPU), reads its memory and,
on CUDA, its compute capability, and fills `shared.capability.DeviceInfo` with the Triton kernels'
limits (kernels.support) so the capability decision is a pure function of it. Memory on CPU is the
system's: total RAM and what /proc/meminfo calls available; on CUDA it is read before any weight is
loaded (the budget in worker/kv/sizing.py subtracts the weights' estimate from it, once).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from kvpact.kernels import support
from kvpact.shared.capability import DeviceInfo, KernelSupport
from kvpact.shared.errors import ConfigError
from kvpact.shared.spec import LayerPlacement

KERNEL_SUPPORT = KernelSupport(
    head_sizes=support.TRITON_HEAD_SIZES,
    block_sizes=support.TRITON_BLOCK_SIZES,
    dtypes=support.TRITON_DTYPES,
    min_compute_capability=support.TRITON_MIN_COMPUTE_CAPABILITY,
    shared_memory_bytes=tuple(sorted(support.shared_memory_table((8, 0)).items())),
)


def kernel_support(compute_capability: tuple[int, int]) -> KernelSupport:
    """KERNEL_SUPPORT with the shared memory the kernels need on this architecture."""
    table = tuple(sorted(support.shared_memory_table(compute_capability).items()))
    return dataclasses.replace(KERNEL_SUPPORT, shared_memory_bytes=table)


@dataclass(frozen=True, slots=True)
class DeviceProbe:
    info: DeviceInfo
    device: torch.device
    memory_total_bytes: int
    memory_free_bytes: int
    torch_version: str = torch.__version__


def probe_device(requested: str = "auto", device_map: tuple[LayerPlacement, ...] = ()) -> DeviceProbe:
    """Raises ConfigError naming --device when the requested device does not exist here."""
    device = _resolve(requested)
    try:
        map_kinds = frozenset(torch.device(p.device).type for p in device_map)
    except RuntimeError as e:
        raise ConfigError(f"--device-map names a device torch does not know: {e}") from e
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        free, total = torch.cuda.mem_get_info(index)
        capability = torch.cuda.get_device_capability(index)
        info = DeviceInfo(
            kind="cuda",
            name=torch.cuda.get_device_name(index),
            compute_capability=capability,
            triton_version=support.triton_version(),
            triton_support=kernel_support(capability),
            device_map_kinds=map_kinds,
            max_shared_memory_per_block=getattr(
                torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None
            ),
        )
        return DeviceProbe(info, device, int(total), int(free))
    total, available = system_memory()
    if device.type == "mps":
        info = DeviceInfo(kind="mps", name="Apple MPS", device_map_kinds=map_kinds)
        return DeviceProbe(info, device, total, available)
    info = DeviceInfo(kind="cpu", name=_cpu_name(), device_map_kinds=map_kinds)
    return DeviceProbe(info, torch.device("cpu"), total, available)


def system_memory() -> tuple[int, int]:
    """(total, available) bytes of system RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return total, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return total, total // 2


def _resolve(requested: str) -> torch.device:
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as e:
        raise ConfigError(
            f"--device {requested!r} is not a device (use auto, cpu, cuda, cuda:N or mps)"
        ) from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {requested}: this machine has no usable CUDA device (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {requested}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {requested}: MPS is not available here (use --device cpu)")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device {requested}: unsupported device type {device.type} (cpu, cuda or mps)")
    return device


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
