"""Tensor parallelism over the decoder: a full model -> rank r's shard of it.

NOTE: rank r of N holds attention heads [r*h/N, (r+1)*h/N) with their KV heads (each rank its own KV
heads when they divide by N; when N is a multiple of the KV heads, the one KV head its query heads
share, replicated as vLLM does) and gate/up rows [r*I/N, (r+1)*I/N): q/k/v and gate/up are
column-parallel. o_proj and down_proj take the matching input columns (row-parallel) and their outputs
are summed over the ranks by `all_reduce`; o_proj's bias is added on rank 0 only. The embedding, the
norms and the LM head are replicated (a tiny share of the weights at these sizes, and no gather of
the logits). `tp_problem` says which shapes cannot be split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch

from kvpact.worker.model.config import ModelConfig
from kvpact.worker.model.llama import LlamaDecoderLayer, LlamaForCausalLM, build_model


@dataclass(frozen=True, slots=True)
class RankShard:
    rank: int
    world: int
    head_start: int  # first attention head of this rank
    num_heads: int
    kv_start: int  # first KV head of this rank
    num_kv_heads: int
    ffn_start: int  # first intermediate row of this rank
    intermediate_size: int


def tp_problem(config: ModelConfig, world: int) -> str:
    """Why the model cannot be split over `world` ranks ("" when it can)."""
    flag = f"--tensor-parallel-size {world}"
    divisors = [n for n in range(1, config.num_heads + 1) if config.num_heads % n == 0]
    sizes = ", ".join(map(str, divisors))
    if config.num_heads % world:
        return f"{flag}: the model's {config.num_heads} attention heads do not divide by {world}; use {sizes}"
    kv = config.num_kv_heads
    if kv % world and world % kv:
        return (
            f"{flag}: the model's {kv} KV heads can be neither split over {world} ranks nor replicated "
            f"(neither number divides the other); use a size among {sizes} that {kv} divides or divides {kv}"
        )
    if config.intermediate_size % world:
        return f"{flag}: the model's MLP width {config.intermediate_size} does not divide by {world}"
    return ""


def rank_shard(config: ModelConfig, rank: int, world: int) -> RankShard:
    heads = config.num_heads // world
    kv = config.num_kv_heads
    if kv % world == 0:
        kv_start, num_kv = rank * (kv // world), kv // world
    else:  # fewer KV heads than ranks: each rank keeps the one its query heads share
        kv_start, num_kv = rank * kv // world, 1
    ffn = config.intermediate_size // world
    return RankShard(rank, world, rank * heads, heads, kv_start, num_kv, rank * ffn, ffn)


@torch.no_grad()
def shard_model(
    full: LlamaForCausalLM, rank: int, world: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> LlamaForCausalLM:
    """Rank `rank`'s shard of `full` (on full's device and dtype); `all_reduce` sums a tensor over the
    ranks in place and returns it."""
    c = full.config
    s = rank_shard(c, rank, world)
    local = replace(
        c, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, intermediate_size=s.intermediate_size
    )
    weight = full.model.embed_tokens.weight
    model = build_model(local, weight.device, weight.dtype)
    d = c.head_dim
    q = slice(s.head_start * d, (s.head_start + s.num_heads) * d)
    k = slice(c.q_size + s.kv_start * d, c.q_size + (s.kv_start + s.num_kv_heads) * d)
    v = slice(c.q_size + c.kv_size + s.kv_start * d, c.q_size + c.kv_size + (s.kv_start + s.num_kv_heads) * d)
    gate = slice(s.ffn_start, s.ffn_start + s.intermediate_size)
    up = slice(c.intermediate_size + s.ffn_start, c.intermediate_size + s.ffn_start + s.intermediate_size)
    model.model.embed_tokens.weight.copy_(weight)
    model.model.norm.weight.copy_(full.model.norm.weight)
    if model.lm_head is not None and full.lm_head is not None:
        model.lm_head.weight.copy_(full.lm_head.weight)
    for mine_module, theirs_module in zip(model.model.layers, full.model.layers, strict=True):
        mine, theirs = cast(LlamaDecoderLayer, mine_module), cast(LlamaDecoderLayer, theirs_module)
        mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
        mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
        attn, full_attn = mine.self_attn, theirs.self_attn
        qkv = full_attn.qkv_proj
        attn.qkv_proj.weight.copy_(torch.cat([qkv.weight[q], qkv.weight[k], qkv.weight[v]]))
        if qkv.bias is not None:
            attn.qkv_proj.bias.copy_(torch.cat([qkv.bias[q], qkv.bias[k], qkv.bias[v]]))
        attn.o_proj.weight.copy_(full_attn.o_proj.weight[:, q])
        if full_attn.o_proj.bias is not None:  # summed over the ranks: added once
            attn.o_proj.bias.copy_(full_attn.o_proj.bias if rank == 0 else torch.zeros_like(attn.o_proj.bias))
        gate_up = theirs.mlp.gate_up_proj.weight
        mine.mlp.gate_up_proj.weight.copy_(torch.cat([gate_up[gate], gate_up[up]]))
        mine.mlp.down_proj.weight.copy_(theirs.mlp.down_proj.weight[:, gate])
        attn.reduce = mine.mlp.reduce = all_reduce
    return model
