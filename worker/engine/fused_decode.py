"""Small steps through every decoder layer in one C call (part of the `cpu-kernels` feature).

A decode step of a few sequences is all weight reads, and the C kernels read the weights at memory
speed (kernels/cpu_paged.py); what was left of a batch-1 step outside its matmuls was the Python
between them: per layer, five module calls, the views of the fused projections, RoPE's four ops, two
residual adds and the attention step (docs/performance.md). So a step that is

- at most SMALL_BATCH_ROWS rows (tokens): decodes, prompt chunks or both,
- on a cache whose decodes run the C decode kernel (paged or eager, float32 or bfloat16 on the CPU),
- of a single-device model with float32 CPU weights, or bfloat16 ones packed (`--dtype bfloat16`), and
  no tensor-parallel reduce,

runs from its token ids to its final hidden states in `kvp_decode_layers_f32`: the embedding row, RoPE's
angles, every layer with the same kernels the layer-by-layer path calls (C linear, RMSNorm, decode)
and RoPE, the K/V write, SiLU and the residual adds written out in C, and the final norm (a bfloat16
model's in torch after the call, rounded as its layer rounds). A batch-1 step is then that one call,
the LM head and the sampler. A prompt chunk's token at
position p is one more row: its sequence's block table, a context of p + 1 tokens; each layer writes
every row's K/V before any row attends, so the chunk attends causally over its cached prefix and
itself, what the model's prefill attention computes (`_step_rows`). That is what keeps a step with a
12-token chunk beside a few decodes (the worker's default budget) near a decode step of as many rows
(docs/performance.md, "Prompt chunks in the C call"). RoPE and SiLU round differently from torch's ops
(libm's cosf / sinf / expf, a fused multiply-add), and a chunk's attention sums in the decode kernel's
order, so the two paths agree within float32 rounding, not bit for bit
(tests/worker/test_fused_decode.py holds them together). Every other step runs the model's Python
forward.

A bfloat16 model's layers run the same way, on its packed bf16 projections (the kernel its layers
call, each projection's input and output, bias included, rounded to bfloat16 as there), with the
residual stream, the norms (their weights copied to float32 once), RoPE, SiLU and the attention's query in
float32 between them, where the layer-by-layer path rounds each op's result to bfloat16. Both are as
far from the same weights run in float32 (the projections' rounding, which they share, is most of it):
tests/worker/test_fused_decode.py holds each to it.

A float32 model whose projections hold exactly a GGUF's Q4_1 values (the bundled SmolLM2 file: the
loader dequantized them; `CpuPagedOps.q4_1_blocks` checks every weight) also gets them as Q4_1 panels,
six bits a weight beside the float32 panels' 32, and steps of a few sequences read those (at most
`CpuPagedOps.quant_max_rows`, 6 with AVX-512: cpu_paged.c, "Q4_1 weights"): a step of a few sequences is
the weights' reads in float32, so it then takes a quarter to a half of the time. The sums are
factored per block, so these steps round in another order than the float32 panels (within float32
rounding, as RoPE's above): one more way the two paths agree within LOGITS_ATOL, not bit for bit.
That is the `quant-kernels` feature (its pre-load checks: worker/startup/checks.py; the values, checked
here, are its one check after loading); `q4` says whether it applies and, when not, why.

The weights' and pools' pointers are gathered once, when the engine is built: nothing replaces a
parameter or a pool after that.
"""

from __future__ import annotations

from typing import cast

import torch

from kvpact.kernels import cpu_paged
from kvpact.kernels.cpu_paged import CpuPagedOps, DecoderLayer, DecoderShape, Layout, ModelEnds
from kvpact.worker.kv.eager import EagerAttentionStep, EagerCache
from kvpact.worker.kv.paged import PagedAttentionStep, PagedCache
from kvpact.worker.model import LlamaForCausalLM
from kvpact.worker.model.llama import LlamaDecoderLayer


class FusedDecode:
    """`run` a step through the C decode layers, or None where it does not qualify (the caller then
    runs the model). Build with `fused_decode`, which says whether this model and cache qualify."""

    def __init__(
        self, ops: CpuPagedOps, model: LlamaForCausalLM, cache: PagedCache | EagerCache, quant: bool = False
    ) -> None:
        c = model.config
        self.ops, self.model = ops, model
        self.shape = DecoderShape(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            cache.scale,
        )
        # the eager cache's "block" is a sequence slot of max_model_len tokens
        self.num_blocks, self.block_size = cache.key[0].shape[:2]
        # engine_setup.use_cpu_kernels packs every decoder projection or none (_check_shapes holds it)
        first = decoder_layers(model)[0].self_attn.qkv_proj.weight
        self.layout = Layout.of(first)
        self.dtype = first.dtype  # float32, or bfloat16 (packed: fused_decode checked)
        self.cache_bf16 = cache.key[0].dtype is torch.bfloat16
        _check_shapes(model, cache, self.layout, ops.panel_width)
        self.float32_copies: list[torch.Tensor] = []  # a bfloat16 model's norm weights
        # why a step of a few rows does not read Q4_1 panels ("": it does)
        self.q4_copies, self.q4_missing = (
            _q4_panels(ops, model, self.layout) if quant else ([], "quant-kernels off")
        )
        # a bfloat16 model's final norm rounds to bfloat16 as its layer does: torch's, after the C call
        final_norm = model.model.norm.weight if self.dtype is torch.float32 else None
        embed = model.model.embed_tokens
        self.ends = ModelEnds(embed.weight, embed.num_embeddings, model.rotary.inv_freq, final_norm)

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        def norm(t: torch.Tensor) -> int:
            """A norm's weight as the C code reads it: float32 (a copy, kept, for a bfloat16 model)."""
            if t.dtype is not torch.float32:
                t = t.float()
                self.float32_copies.append(t)
            return t.data_ptr()

        self.layers = (DecoderLayer * c.num_layers)(
            *(
                DecoderLayer(
                    norm(layer.input_layernorm.weight),
                    ptr(layer.self_attn.qkv_proj.weight),
                    ptr(layer.self_attn.qkv_proj.bias),
                    ptr(layer.self_attn.o_proj.weight),
                    ptr(layer.self_attn.o_proj.bias),
                    norm(layer.post_attention_layernorm.weight),
                    ptr(layer.mlp.gate_up_proj.weight),
                    ptr(layer.mlp.down_proj.weight),
                    ptr(cache.key[i]),
                    ptr(cache.value[i]),
                    *(ptr(t) for t in self.q4_copies[4 * i : 4 * i + 4]),
                )
                for i, layer in enumerate(decoder_layers(model))
            )
        )

    @property
    def q4(self) -> str:
        """What the startup log says of the Q4_1 panels: yes and for how many rows, or no and why."""
        if self.q4_missing:
            return f"no: {self.q4_missing}"
        return f"yes: {len(self.q4_copies)} projections, for steps of up to {self.ops.quant_max_rows} rows"

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: object) -> torch.Tensor | None:
        """The final hidden states [rows, hidden] of a qualifying step, else None."""
        rows = input_ids.shape[0]
        if not 0 < rows <= cpu_paged.SMALL_BATCH_ROWS:
            return None
        step = _step_rows(attn, positions, self.block_size)
        if step is None:
            return None
        x = self.ops.decode_layers(
            input_ids,
            positions,
            self.ends,
            self.layers,
            self.shape,
            *step,
            self.block_size,
            self.num_blocks * self.block_size,
            layout=self.layout,
            cache_bf16=self.cache_bf16,
        )
        return x if self.ends.final_norm is not None else self.model.model.norm(x.to(self.dtype))


def _q4_panels(ops: CpuPagedOps, model: LlamaForCausalLM, layout: Layout) -> tuple[list[torch.Tensor], str]:
    """Each layer's qkv, o, gate_up and down projections as Q4_1 panels (`CpuPagedOps.pack_q4`), in that
    order, and ""; or none, and why not, unless every projection packs."""
    if layout is not Layout.PACKED_F32:
        return [], "the projections are not float32 panels"
    panels = []
    for i, layer in enumerate(decoder_layers(model)):
        for name, linear in (
            ("qkv", layer.self_attn.qkv_proj),
            ("o", layer.self_attn.o_proj),
            ("gate_up", layer.mlp.gate_up_proj),
            ("down", layer.mlp.down_proj),
        ):
            q4 = ops.pack_q4(ops.unpack(linear.weight))
            if q4 is None:
                return [], f"layer {i}'s {name} projection does not hold exactly Q4_1 values"
            panels.append(q4)
    return panels, ""


def _step_rows(
    attn: object, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(slot_mapping int64, block_tables int32, context_lens int32), one row per token, of a step on a
    cache whose decodes run the C decode kernel (`fused_decode` built this for no other), else None.
    A prompt chunk's token at position p is a row like a decode's: its sequence's table and a context of
    p + 1, as every row's K/V is written before any row attends (kvp_decode_layers_f32), so the chunk
    attends causally over its cached prefix and itself. Decodes-only steps reuse the step's tensors."""
    if isinstance(attn, PagedAttentionStep):
        if not attn.has_prefills:
            return attn.slot_mapping, attn.decode_tables, attn.decode_context_lens
        decodes, prefills = attn.decode_tables, attn.prefill_tables
        lengths = attn.prefill_start_loc[1:] - attn.prefill_start_loc[:-1]
        tables = torch.zeros(positions.shape[0], max(decodes.shape[1], prefills.shape[1]), dtype=torch.int32)
        tables[: attn.num_decodes, : decodes.shape[1]] = decodes
        tables[attn.num_decodes :, : prefills.shape[1]] = prefills.repeat_interleave(lengths, 0)
        return attn.slot_mapping, tables, (positions + 1).to(torch.int32)
    if isinstance(attn, EagerAttentionStep):
        if not attn.prefills:
            return attn.decode_flat_slots, attn.decode_tables, attn.decode_context_lens
        chunk_slots = [slot for slot, _, n, _ in attn.prefills for _ in range(n)]
        slots = torch.cat((attn.decode_slots, torch.tensor(chunk_slots, dtype=torch.long)))
        return slots * block_size + positions, slots.to(torch.int32)[:, None], (positions + 1).to(torch.int32)
    return None


def fused_decode(model: LlamaForCausalLM, cache: object, quant: bool = False) -> FusedDecode | None:
    """The C decode layers for this model and cache (with its Q4_1 panels where `quant`: quant-kernels
    realized, and every projection packs), or None where they do not apply: a cache without
    the C decode kernel (--cpu-kernels off or fallen back, a staged --device-map), weights not all float32
    or all bfloat16 on the CPU, bfloat16 projections not packed (a build without panels), or tensor
    parallel (a rank's layers reduce over the others')."""
    weights = list(model.parameters())
    dtype = weights[0].dtype if weights else None
    if (
        not isinstance(cache, PagedCache | EagerCache)
        or not cache.cpu_kernels
        or cache.key[0].dtype not in cpu_paged.CACHE_DTYPES
        or dtype not in (torch.float32, torch.bfloat16)
        or any(w.dtype != dtype or not w.is_cpu or not w.is_contiguous() for w in weights)
        or (
            dtype is torch.bfloat16
            and Layout.of(decoder_layers(model)[0].self_attn.qkv_proj.weight) is not Layout.PACKED_BF16
        )
        or any(
            layer.self_attn.reduce is not None or layer.mlp.reduce is not None
            for layer in decoder_layers(model)
        )
    ):
        return None
    return FusedDecode(cpu_paged.required(torch.float32, torch.device("cpu")), model, cache, quant)


def _check_shapes(
    model: LlamaForCausalLM, cache: PagedCache | EagerCache, layout: Layout, panel_width: int
) -> None:
    """What the C code reads through the pointers, held to the config it is told: every weight's and
    pool's shape (contiguous weights of one dtype and a float32 or bfloat16 first pool checked by
    `fused_decode`, every pool of the first's dtype; every projection in `layout`: as `pack` laid it out
    in panels of `panel_width`, or [out, in]). A mismatch is a bug in how the engine was built, raised here
    rather than read out of bounds in C."""
    c = model.config
    q, kv, hd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
    layers = decoder_layers(model)

    def projection(out_features: int, in_features: int) -> tuple[int, ...]:
        p = panel_width
        if layout is Layout.PACKED_BF16:
            return (out_features // p, in_features // 2, p, 2)
        return (
            (out_features // p, in_features, p)
            if layout is Layout.PACKED_F32
            else (out_features, in_features)
        )

    want = {
        "input_layernorm.weight": (c.hidden_size,),
        "self_attn.qkv_proj.weight": projection(q + 2 * kv, c.hidden_size),
        "self_attn.qkv_proj.bias": (q + 2 * kv,),
        "self_attn.o_proj.weight": projection(c.hidden_size, q),
        "self_attn.o_proj.bias": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "mlp.gate_up_proj.weight": projection(2 * c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": projection(c.hidden_size, c.intermediate_size),
    }
    embed, inv_freq, norm = model.model.embed_tokens, model.rotary.inv_freq, model.model.norm.weight
    # a tied head packs the table as the projections are packed (`use_cpu_kernels`), or leaves it
    table = (
        projection(embed.num_embeddings, c.hidden_size)
        if embed.panel
        else (embed.num_embeddings, c.hidden_size)
    )
    for name, tensor, shape in (
        ("the embedding", embed.weight, table),
        ("RoPE's inv_freq", inv_freq, (hd // 2,)),
        ("the final norm", norm, (c.hidden_size,)),
    ):
        if tuple(tensor.shape) != shape or not tensor.is_contiguous() or not tensor.is_cpu:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the C code reads a contiguous {shape}")
    if inv_freq.dtype is not torch.float32:
        raise ValueError(f"RoPE's inv_freq is {inv_freq.dtype}, the C code reads float32")
    if len(cache.key) != len(layers) or len(cache.value) != len(layers):
        raise ValueError(f"the cache has {len(cache.key)} layers' pools, the model {len(layers)} layers")
    for i, layer in enumerate(layers):
        for name, tensor in layer.named_parameters():
            if name in want and tuple(tensor.shape) != want[name]:
                raise ValueError(
                    f"layer {i} {name}: shape {tuple(tensor.shape)}, the config says {want[name]}"
                )
        for pool in (cache.key[i], cache.value[i]):
            if (
                pool.dim() != 4
                or tuple(pool.shape[2:]) != (c.num_kv_heads, hd)
                or not pool.is_contiguous()
                or pool.dtype != cache.key[0].dtype
            ):
                raise ValueError(
                    f"layer {i}'s KV pool: {pool.dtype}, shape {tuple(pool.shape)} strides {pool.stride()}, "
                    f"the C decode layers need a contiguous {cache.key[0].dtype} [blocks, block_size, "
                    f"{c.num_kv_heads}, {hd}]"
                )


def decoder_layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return [cast(LlamaDecoderLayer, layer) for layer in model.model.layers]
