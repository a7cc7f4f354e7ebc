"""The seam between the model and the KV cache.

The model runs a ragged flat batch: every token of every sequence scheduled this step, concatenated
(`num_tokens` rows). In each layer it computes q, k, v, applies RoPE, and hands them to the step's
`AttentionStep`, which writes k/v into its cache and returns the attention output. The model never
touches a cache; each cache (eager slots, paged blocks with the torch or Triton backend) builds its
own `AttentionStep` for a step from the scheduler's decisions.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionStep(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], each
        token's [heads, head_dim] contiguous (tokens may be strided: views of the fused projection).
        Writes k, v to this layer's cache at the tokens' positions, then returns causal attention of
        each query over its sequence's cached tokens up to and including its own position:
        [num_tokens, num_heads, head_dim]."""
        ...
