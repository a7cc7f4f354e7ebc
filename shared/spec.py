"""What a worker is asked to run (CLI -> WorkerSpec -> protobuf, converted in shared/wire.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpact.shared.intent import CacheIntent


@dataclass(frozen=True, slots=True)
class LayerPlacement:
    device: str  # "cpu", "cuda:0", "mps"
    num_layers: int


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    model: str = ""  # HF directory or .gguf file; "" = the bundled default model
    device: str = "auto"  # auto, cpu, cuda, cuda:N, mps
    device_map: tuple[LayerPlacement, ...] = ()  # empty = every layer on `device`
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA), float32, float16, bfloat16
    max_model_len: int = 0  # 0 = min(model's max positions, the device default)
    max_num_seqs: int = 0  # 0 = default
    max_num_batched_tokens: int = 0  # 0 = default
    cache: CacheIntent = field(default_factory=CacheIntent)
    # --max-model-len auto (and the CUDA default): the longest sequence the realized cache can hold, up to
    # the model's positions; max_model_len is then 0
    max_model_len_auto: bool = False


def parse_device_map(text: str) -> tuple[LayerPlacement, ...]:
    """`cuda:0=20,cpu=10` -> 20 layers on cuda:0 then 10 on cpu (in layer order)."""
    placements = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, sep, count = part.rpartition("=")
        if not sep or not device or not count.isdigit() or not 0 < int(count) < 2**32:
            raise ValueError(
                f"--device-map expects DEVICE=NUM_LAYERS[,...] (e.g. cuda:0=20,cpu=10), got {part!r}"
            )
        kind, colon, index = device.partition(":")
        if not (device in ("cpu", "cuda", "mps") or (kind == "cuda" and colon and index.isdigit())):
            raise ValueError(
                f"--device-map: unknown device {device!r} in {part!r}; use cpu, cuda, cuda:N or mps"
            )
        placements.append(LayerPlacement(device=device, num_layers=int(count)))
    return tuple(placements)
