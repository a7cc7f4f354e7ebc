"""The decoder's small building blocks: RMSNorm, the SwiGLU MLP (gate and up fused in one matmul), and
the Linear every projection uses."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # F.linear's
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps)


class Linear(nn.Linear):
    """nn.Linear whose matmul can be swapped: `matmul` is F.linear unless the model's `use_kernels`
    installed another (the C kernels' small-batch linear, kernels/cpu_paged.py), or `use_packed` laid
    the weight out for one."""

    matmul: LinearFn = staticmethod(F.linear)

    @property
    def packed(self) -> bool:
        """`weight` is laid out for `matmul` alone (kernels/cpu_paged.py `pack`), not [out, in]."""
        return self.weight.dim() > 2

    def use_packed(self, weight: torch.Tensor, matmul: LinearFn) -> None:
        """From now on `weight` (this layer's, packed for `matmul`) replaces [out, in], and `matmul`
        runs every call. The [out, in] tensor is freed, so the weights are held once."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose table `use_packed` can lay out for the packed matmul of a tied LM head (which
    reads this same tensor): a lookup then takes each token's features from its panel, where they lie
    `panel` elements apart (float32), or in pairs `panel` pairs apart (bfloat16, kernels/cpu_paged.py
    `pack`)."""

    def reset_parameters(self) -> None:
        """Nothing to initialise: `build_model` allocates the table on the meta device and the loader
        writes every row. (nn.Embedding's own `normal_` on a meta tensor imports torch._dynamo: 1.4-1.9 s
        of every worker's start on a 2-core machine, for values never read.)"""

    @property
    def panel(self) -> int:
        """The packed table's panel width (kernels/cpu_paged.py `pack`); 0: [vocab, hidden]."""
        return self.weight.shape[2] if self.weight.dim() > 2 else 0

    def use_packed(self, weight: torch.Tensor) -> None:
        """From now on `weight`, this table packed (`pack`'s layout), replaces the table."""
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        panel = self.panel
        if not panel:
            return super().forward(input_ids)
        if input_ids.numel():
            low, high = torch.aminmax(input_ids)
            if not 0 <= int(low) <= int(high) < self.num_embeddings:
                raise IndexError(f"token ids must be in [0, {self.num_embeddings}): index out of range")
        rows = self.weight[input_ids // panel, :, input_ids % panel]  # [..., hidden] or [..., hidden / 2, 2]
        return rows.flatten(-2) if rows.dim() > input_ids.dim() + 1 else rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)`, the variance computed in float32, the result in x's dtype."""
    if x.dtype == torch.float32:  # the same math as below, one op instead of six
        return torch.rms_norm(x, weight.shape, weight, eps)  # F.rms_norm, less a check
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    """`norm(x, weight, eps)`: `rms_norm` unless the model's `use_kernels` installed another (the C
    kernels' RMSNorm for float32 weights, kernels/cpu_paged.py)."""

    norm: NormFn = staticmethod(rms_norm)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`. `gate_up_proj.weight` is `[2 * intermediate, hidden]`: the gate
    rows first, then the up rows (the loader fills each half from the checkpoint's gate/up_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        # tensor parallel (worker/model/tensor_parallel.py): sums down_proj's partial output over the ranks
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, 2, intermediate] unbound: the two halves as views, cheaper to dispatch than split
        gate, up = self.gate_up_proj(x).view(-1, 2, self.intermediate_size).unbind(1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.reduce is None else self.reduce(out)
