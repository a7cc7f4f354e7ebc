"""What a worker is asked to run (CLI -> WorkerSpec -> protobuf, converted in shared/handshake_pb.py).
Its fields declare the `worker` options that say it (shared/options.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvpact.shared.features import FeatureIntents
from kvpact.shared.intent import CacheIntent
from kvpact.shared.options import check_options, option, whole_number


@dataclass(frozen=True, slots=True)
class LayerPlacement:
    device: str  # "cpu", "cuda:0", "mps"
    num_layers: int


MODEL = "model"  # the --help group of `worker` these options are shown in
DTYPES = ("auto", "float32", "float16", "bfloat16")


def parse_device(value: str) -> str:
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda", "mps") or (kind == "cuda" and index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda, cuda:N or mps, got {value!r}")


def _device_map(value: str) -> tuple[LayerPlacement, ...]:
    try:
        return parse_device_map(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _max_model_len(value: str) -> tuple[int, bool]:
    """A whole number, or "auto" (fit it to the realized KV cache): (max_model_len, max_model_len_auto)."""
    return (0, True) if value == "auto" else (whole_number(value, 0), False)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the worker is asked to run: one field per `worker` option (shared/options.py); the cache
    intent's own options are CacheIntent's and PagedAttentionConfig's (shared/intent.py), the other
    features' FeatureIntents' (shared/features.py)."""

    model: str = option(
        "",
        "--model",
        "Hugging Face model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
        group=MODEL,
    )
    device: str = option(
        "auto", "--device", "auto, cpu, cuda, cuda:N or mps (default auto)", type=parse_device, group=MODEL
    )
    device_map: tuple[LayerPlacement, ...] = option(  # empty = every layer on `device`
        (),
        "--device-map",
        "place runs of decoder layers on devices in order, e.g. cuda:0=20,cpu=10",
        type=_device_map,
        metavar="DEVICE=NUM_LAYERS[,...]",
        group=MODEL,
    )
    dtype: str = option(
        "auto", "--dtype", "weight dtype (default auto: the device's default)", choices=DTYPES, group=MODEL
    )
    max_model_len: int = option(  # 0 = the device default (see max_model_len_auto)
        0,
        "--max-model-len",
        "longest sequence in tokens; auto: the longest one sequence can have in the realized KV cache, "
        "up to the model's positions (logged with how it was chosen). A value that cannot fit: under "
        "--paged-attn on startup fails, under auto it falls back to the eager cache; either way the message "
        "names the largest value that fits (0 = default: auto on CUDA, min(model, 2048) on CPU/MPS)",
        type=_max_model_len,
        metavar="N|auto",
        group=MODEL,
        into=("max_model_len", "max_model_len_auto"),
        cli_default=(0, False),
        minimum=0,
    )
    max_num_seqs: int = option(
        0, "--max-num-seqs", "most sequences run at once (0 = default)", minimum=0, group=MODEL
    )
    max_num_batched_tokens: int = option(
        0, "--max-num-batched-tokens", "most tokens in one engine step (0 = default)", minimum=0, group=MODEL
    )
    prompt_tokens_beside_decodes: int = option(
        0,
        "--prompt-tokens-beside-decodes",
        "most prompt tokens in a step that also carries decodes: each decode waits for the whole step, so "
        "a smaller N bounds inter-token latency, a larger one prefills a newcomer in fewer steps (0 = "
        "default: the device's, none with an explicit --max-num-batched-tokens)",
        metavar="N",
        minimum=0,
        group=MODEL,
    )
    tensor_parallel_size: int = option(
        1,
        "--tensor-parallel-size",
        "shard the model over N ranks, one process each (the worker spawns ranks 1..N-1 itself; CPU/gloo "
        "in this build; the attention heads must divide by N)",
        metavar="N",
        minimum=1,
        maximum=64,
        group=MODEL,
    )
    threads: int | None = option(
        None,
        "--threads",
        "CPU threads for this worker's torch ops (default: its share of the machine: the Ray bundle's "
        "num_cpus, else what the OS allows this process)",
        metavar="N",
        minimum=1,
        group=MODEL,
    )
    cache: CacheIntent = field(default_factory=CacheIntent)
    features: FeatureIntents = field(default_factory=FeatureIntents)  # every feature but paged-attn
    # --max-model-len auto (and the CUDA default): the longest sequence the realized cache can hold, up to
    # the model's positions; max_model_len is then 0
    max_model_len_auto: bool = False

    def __post_init__(self) -> None:
        check_options(self)


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
