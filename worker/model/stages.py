"""Pipeline stages inside one worker: runs of decoder layers, each run on its own device.

NOTE: a `--device-map` of two or more entries always runs as stages, even when every entry names the
same device (`cpu=15,cpu=15`), so the CPU tests run the code a `cuda:0=20,cpu=10` map runs on a GPU.
Without a map the model is one stage on `--device`. The embedding (and the rotary table) live on the
first stage's device, the final norm and an untied LM head on the last one's; hidden states, cos and sin
move to each stage's device before its first layer. Every stage's KV cache lives on its stage's device
(worker/kv/staged.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Stage:
    device: torch.device
    start: int  # first decoder layer of the run
    stop: int  # one past its last layer

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    def describe(self) -> str:
        return f"layers {self.start}-{self.stop - 1} on {self.device}"


def single_stage(device: torch.device | str, num_layers: int) -> tuple[Stage, ...]:
    return (Stage(torch.device(device), 0, num_layers),)


def plan_stages(
    placements: Sequence[tuple[str, int]], num_layers: int, device: torch.device | str
) -> tuple[Stage, ...]:
    """(device, number of layers) runs in layer order -> stages; no runs = one stage on `device`.
    The counts must add up to `num_layers` (startup checks that first, naming --device-map)."""
    if not placements:
        return single_stage(device, num_layers)
    stages, start = [], 0
    for name, count in placements:
        stages.append(Stage(torch.device(name), start, start + count))
        start += count
    if start != num_layers:
        raise ValueError(f"the stages place {start} layers, the model has {num_layers}")
    return tuple(stages)
