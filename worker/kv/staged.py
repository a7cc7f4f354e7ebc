"""A KV cache split by stages: one eager cache per stage, on that stage's device, over its layers.

NOTE: each stage's cache holds only its own layers (`layer - stage.start` inside it) and has the same
slots as every other stage's, so the scheduler's one slot per sequence addresses all of them. A step
builds every stage's AttentionStep (its metadata on its own device) and sends each layer to its stage's.
Only the eager cache is staged: PagedAttention falls back for a staged map (shared/reasons.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvpact.shared.scheduler_choice import CacheKind
from kvpact.worker.engine.attention import AttentionStep
from kvpact.worker.engine.sequence import ScheduledChunk
from kvpact.worker.kv.eager import EagerCache
from kvpact.worker.model.stages import Stage


class StagedCache:
    kind = CacheKind.EAGER

    def __init__(self, stages: tuple[Stage, ...], make: Callable[[int, torch.device], EagerCache]) -> None:
        """`make(num_layers, device)` builds one stage's cache."""
        self.stages = stages
        self.caches = [make(stage.num_layers, stage.device) for stage in stages]
        # layer -> (its stage, its index in that stage's cache)
        self.layer_at = [(i, n - s.start) for i, s in enumerate(stages) for n in range(s.start, s.stop)]
        first = self.caches[0]
        self.num_slots, self.max_model_len = first.num_slots, first.max_model_len
        self.sliding_window = first.sliding_window
        pairs = zip(stages, self.caches, strict=True)
        self.kernels = "; ".join(f"{s.describe()}: {c.kernels}" for s, c in pairs)

    @property
    def cpu_kernels(self) -> bool:
        """Whether every stage runs the C kernels (a CUDA stage never does)."""
        return all(c.cpu_kernels for c in self.caches)

    @property
    def memory_bytes(self) -> int:
        return sum(c.memory_bytes for c in self.caches)

    def attention_step(self, chunks: list[ScheduledChunk], num_decodes: int) -> StagedAttentionStep:
        steps = [c.attention_step(chunks, num_decodes) for c in self.caches]
        return StagedAttentionStep(steps, self.layer_at)


class StagedAttentionStep:
    def __init__(self, steps: Sequence[AttentionStep], layer_at: list[tuple[int, int]]) -> None:
        self.steps, self.layer_at = steps, layer_at

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        stage, layer = self.layer_at[layer_idx]
        return self.steps[stage].forward(layer, q, k, v)
