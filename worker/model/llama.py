"""The Llama-family decoder (Llama / SmolLM2, Mistral, Qwen2) over a ragged flat batch.

One step runs every scheduled token of every sequence at once, concatenated (nano-vllm / vLLM style):

    input_ids  [num_tokens] long     the new tokens of all sequences, sequence after sequence
    positions  [num_tokens] long     each token's position in its own sequence (drives RoPE)
    attn       AttentionStep         knows the batch layout; owns the KV cache write and the attention

Each layer computes q `[num_tokens, num_heads, head_dim]` and k, v `[num_tokens, num_kv_heads,
head_dim]` (RoPE applied to q and k; views into the fused projection's output, so tokens may be
strided but each token's [heads, head_dim] is contiguous) and calls `attn.forward(layer_idx, q, k, v)`, which
returns `[num_tokens, num_heads, head_dim]` computed with scale `config.head_dim ** -0.5`. The model
never touches a cache. q/k/v and gate/up projections are fused into one matmul each.

The layers run as `stages` (worker/model/stages.py): one on the model's device, or the runs of a
`--device-map`; `input_ids` and `positions` are on the first stage's device, the hidden states come back
on the last one's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvpact.shared.errors import ModelLoadError
from kvpact.worker.model.config import ModelConfig
from kvpact.worker.model.layers import Embedding, Linear, LinearFn, NormFn, RMSNorm, SwiGLU
from kvpact.worker.model.rope import RotaryEmbedding, apply_rotary
from kvpact.worker.model.stages import Stage, single_stage

if TYPE_CHECKING:
    from kvpact.worker.engine.attention import AttentionStep


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size, self.kv_size = config.q_size, config.kv_size
        # Rows: q (num_heads * head_dim), then k, then v (num_kv_heads * head_dim each).
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        # tensor parallel (worker/model/tensor_parallel.py): sums o_proj's partial output over the ranks
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionStep
    ) -> torch.Tensor:
        h, kv = self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(x).view(-1, h + 2 * kv, self.head_dim)  # q heads, then k, then v
        # q and k rotated together (one set of RoPE ops per layer, not two); q, k and v stay views
        # of their rows, each token's [heads, head_dim] contiguous. `narrow`, not `split`: a batch-1
        # step is mostly dispatch outside its matmuls, and split costs about two narrows.
        qk = apply_rotary(heads.narrow(1, 0, h + kv), cos, sin)
        q, k, v = qk.narrow(1, 0, h), qk.narrow(1, h, kv), heads.narrow(1, h + kv, kv)
        out = self.o_proj(attn.forward(self.layer_idx, q, k, v).reshape(-1, self.q_size))
        return out if self.reduce is None else self.reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionStep
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`forward` -> final hidden states `[num_tokens, hidden]`; `compute_logits` on the rows the
    sampler needs (usually each sequence's last token) -> `[n, vocab]` float32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.stages: tuple[Stage, ...] = ()  # set by build_model; () = every layer where its weights are
        self.head_matmul: LinearFn = F.linear  # compute_logits'; use_kernels swaps it with every Linear's

    def use_kernels(self, matmul: LinearFn, norm: NormFn) -> None:
        """From now on every projection and the LM head run `matmul` (F.linear's arguments), and every
        RMSNorm `norm` (x, weight, eps)."""
        for module in self.modules():
            if isinstance(module, Linear) and not module.packed:  # a packed one keeps its own
                module.matmul = matmul
            elif isinstance(module, RMSNorm):
                module.norm = norm
        self.head_matmul = matmul

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionStep) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # once per step, laid out for every layer
        # The hidden states move to each stage's device (a no-op on the same device).
        for stage in self.stages or single_stage(x.device, len(self.model.layers)):
            x, cos, sin = x.to(stage.device), cos.to(stage.device), sin.to(stage.device)
            for layer in self.model.layers[stage.start : stage.stop]:
                x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """On the LM head's device: the last stage's, or a tied embedding's (the first stage's): moving
        the sampled rows there is cheaper than a second copy of the vocabulary matrix."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.head_matmul(hidden.to(weight.device), weight, None).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Copy Hugging Face-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the
        fused parameters, casting to the model's dtype and device. Raises ModelLoadError naming
        `source` for an unknown tensor, a wrong shape, or a parameter the checkpoint lacks."""
        params = dict(self.named_parameters())
        filled: dict[str, set[str]] = {name: set() for name in params}
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                continue
            param_name, part, start, stop = target
            if param_name not in params:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
            view = params[param_name].data[start:stop] if part else params[param_name].data
            if tuple(view.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}"
                )
            view.copy_(tensor)
            filled[param_name].add(part)
        missing = []
        for param_name, got in filled.items():
            lacking = sorted(set(_parts(param_name) or ("",)) - got)
            if lacking:
                missing.append(param_name + (f" ({', '.join(lacking)})" if lacking != [""] else ""))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"{source}: missing weights for {shown}")

    def _target(self, name: str) -> tuple[str, str, int, int] | None:
        """Checkpoint name -> (parameter name, part, row start, row stop); None for tensors to skip.
        part is "" for a whole parameter, else the fused slice ("q", "k", "v", "gate", "up")."""
        if name.endswith("rotary_emb.inv_freq") or (name.startswith("lm_head.") and self.lm_head is None):
            return None
        c = self.config
        for part, (start, stop) in {
            "q": (0, c.q_size),
            "k": (c.q_size, c.q_size + c.kv_size),
            "v": (c.q_size + c.kv_size, c.q_size + 2 * c.kv_size),
        }.items():
            if f".self_attn.{part}_proj." in name:
                return name.replace(f".{part}_proj.", ".qkv_proj."), part, start, stop
        for part, (start, stop) in {
            "gate": (0, c.intermediate_size),
            "up": (c.intermediate_size, 2 * c.intermediate_size),
        }.items():
            if f".mlp.{part}_proj." in name:
                return name.replace(f".{part}_proj.", ".gate_up_proj."), part, start, stop
        return name, "", 0, 0


def _parts(param_name: str) -> tuple[str, ...]:
    if ".qkv_proj." in param_name:
        return ("q", "k", "v")
    if ".gate_up_proj." in param_name:
        return ("gate", "up")
    return ()


def _allocate(module: nn.Module, device: torch.device | str) -> None:
    """`module.to_empty(device=device)`, but through torch.empty: to_empty's torch.empty_like of a meta
    tensor imports sympy (through torch._refs), half a second of every worker's start."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    stages: tuple[Stage, ...] | None = None,
) -> LlamaForCausalLM:
    """An uninitialised model in `dtype` (weights allocated, not written): fill it with `load_weights`.
    Nothing is initialised twice, so building costs only the allocation. `stages` None: every layer on
    `device`; else each layer on its stage's device, the embedding on the first, norm and head on the last."""
    stages = stages or single_stage(device, config.num_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype)
    first, last = stages[0].device, stages[-1].device
    _allocate(model.model.embed_tokens, first)
    for stage in stages:
        for layer in model.model.layers[stage.start : stage.stop]:
            _allocate(layer, stage.device)
    _allocate(model.model.norm, last)
    if model.lm_head is not None:
        _allocate(model.lm_head, last)
    model.stages = stages if len(stages) > 1 else ()  # one stage: wherever the model is moved later
    return model.eval()
