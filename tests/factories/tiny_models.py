"""Tiny random models on disk, in the formats the real loader reads, plus a reference attention.

    make_tiny_llama(dir)   Hugging Face directory: config.json, model.safetensors, tokenizer.json,
                           tokenizer_config.json (ChatML chat_template). Written by transformers.
    make_tiny_qwen2(dir)   the same for Qwen2 (q/k/v bias).
    make_tiny_gguf(path)   a GGUF file (llama or qwen2 arch; f32, f16 or q8_0 tensors) holding the
                           same weights as make_tiny_llama/make_tiny_qwen2 with the same arguments.

Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128, a 384-token
byte-level BPE vocabulary (ids 0/1/2 = <|endoftext|>, <|im_start|>, <|im_end|>; eos = 2) trained on
text with emoji, CJK and accents, so characters really split across tokens. Pass head_dim=64 (and
hidden_size=num_heads*64) for kernel tests. Same arguments and seed -> same weights, every time.
Weights are drawn with a wide spread (std 0.2, biases and norms randomised too), so logits are far
from ties and greedy decoding is stable across backends.

    ContiguousAttention    a plain AttentionStep: per-sequence contiguous K/V, SDPA. Slow, obviously right.
    greedy_generate(model, prompts, n)  prefill all prompts as one flat batch, then decode them together.
    transformers_greedy(hf_model, prompt, n)  the reference continuation from a transformers model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvpact.worker.tokenizer.tiny import (
    BOS_ID,
    CHATML_TEMPLATE,
    EOS_ID,
    SPECIAL_TOKENS,
    tiny_tokenizer,
    tokenizer_json,
    write_tokenizer_files,
)

__all__ = ["BOS_ID", "CHATML_TEMPLATE", "EOS_ID", "SPECIAL_TOKENS", "tiny_tokenizer"]  # for the tests


def _hf_config(
    architecture: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    attention_bias: bool,
    tie_word_embeddings: bool,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=tiny_tokenizer().get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta},
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if architecture == "qwen2":
        if head_dim != hidden_size // num_heads:
            raise ValueError("Qwen2 has head_dim = hidden_size // num_heads")
        return Qwen2Config(**common)
    return LlamaConfig(**common, head_dim=head_dim, attention_bias=attention_bias)


def tiny_hf_model(
    architecture: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    attention_bias: bool = False,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    std: float = 0.2,
):
    """The transformers model (float32, eval mode) the make_* functions write. `architecture`:
    "llama" or "qwen2". Every parameter is random: matrices N(0, std), biases N(0, std), norm weights
    1 + N(0, 0.1)."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(
        architecture,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        attention_bias=attention_bias,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else std * noise)
    return model.eval()


def make_tiny_llama(directory: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Path:
    """Write a tiny random Llama as a Hugging Face directory; returns the directory. `kwargs` are
    tiny_hf_model's (hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
    attention_bias, tie_word_embeddings, rope_theta, rope_scaling, max_position_embeddings, seed, std).
    `dtype` is the stored weight dtype."""
    return _write_hf("llama", Path(directory), dtype, kwargs)


def make_tiny_qwen2(directory: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: Any) -> Path:
    """Write a tiny random Qwen2 (q/k/v bias, untied by default) as a Hugging Face directory."""
    return _write_hf("qwen2", Path(directory), dtype, kwargs)


def _write_hf(architecture: str, directory: Path, dtype: torch.dtype, kwargs: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tiny_hf_model(architecture, **kwargs).to(dtype).save_pretrained(directory)
    write_tokenizer_files(directory)
    return directory


# --- GGUF --------------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama models: `[head, half, i]` -> `[head, i, half]`."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(
    path: str | Path, *, architecture: str = "llama", file_type: str = "f32", **kwargs: Any
) -> Path:
    """Write the tiny model as a GGUF file the way llama.cpp's converter would (llama: Q/K rows
    permuted); returns the path. `architecture`: "llama" or "qwen2" (then q/k/v bias). `file_type`:
    "f32", "f16", "q8_0" or "q4_1" (2-D weights; norms stay f32; q4_1 as llama.cpp's Q4_1 files are, the
    bundled one among them: the token embedding and output in q8_0, every row a multiple of 32 long).
    Same kwargs as make_tiny_llama; with equal kwargs and file_type f32 the weights equal
    make_tiny_llama's / make_tiny_qwen2's exactly."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_model(architecture, **kwargs)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    if c.rope_parameters.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(c.rope_parameters["factor"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    _add_gguf_tokenizer(writer)
    qtypes = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1,
    }
    qtype = qtypes[file_type]
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name)
        data = tensor.detach().float().numpy()
        kind = name.split(".")[-2]
        if architecture == "llama" and kind in heads:
            data = _llama_cpp_permute(data, heads[kind])
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            kind_qtype = qtypes["q8_0"] if file_type == "q4_1" and not name.startswith("blk.") else qtype
            writer.add_tensor(
                name, gguf.quants.quantize(np.ascontiguousarray(data), kind_qtype), raw_dtype=kind_qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gguf_tokenizer(writer: Any) -> None:
    import gguf

    data = json.loads(tokenizer_json())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


# --- reference attention and a greedy runner ---------------------------------------------------------


class ContiguousAttention:
    """A reference `AttentionStep`: each sequence's K/V kept as contiguous tensors, attention by SDPA.

    attn = ContiguousAttention()
    hidden = model(ids, positions, attn.step(seq_ids=[0, 1], num_tokens=[5, 3]))  # prefill 2 sequences
    hidden = model(next_ids, positions, attn.step([0, 1], [1, 1]))                # decode both
    """

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._layout: list[tuple[int, int]] = []

    def step(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> ContiguousAttention:
        """Declare this step's layout: the tokens are sequence after sequence, `num_tokens` each."""
        self._layout = list(zip(seq_ids, num_tokens, strict=True))
        return self

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outputs, start = [], 0
        for seq_id, n in self._layout:
            keys, values = k[start : start + n], v[start : start + n]
            if (seq_id, layer_idx) in self.kv:
                old_k, old_v = self.kv[(seq_id, layer_idx)]
                keys, values = torch.cat([old_k, keys]), torch.cat([old_v, values])
            self.kv[(seq_id, layer_idx)] = (keys, values)
            group = q.shape[1] // k.shape[1]
            total = keys.shape[0]
            mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=total - n)
            out = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1),
                keys.repeat_interleave(group, dim=1).transpose(0, 1),
                values.repeat_interleave(group, dim=1).transpose(0, 1),
                attn_mask=mask,
            )
            outputs.append(out.transpose(0, 1))
            start += n
        return torch.cat(outputs)


@torch.inference_mode()
def greedy_generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts`: one flat prefill of all prompts, then batched decode steps
    with a ContiguousAttention. Never stops early (no eos handling)."""
    attn = ContiguousAttention()
    seq_ids = list(range(len(prompts)))
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    hidden = model(ids, positions, attn.step(seq_ids, lengths))
    last = torch.tensor(lengths).cumsum(0) - 1
    next_ids = model.compute_logits(hidden[last]).argmax(-1)
    outputs = [[int(t)] for t in next_ids]
    for _ in range(max_new_tokens - 1):
        positions = torch.tensor(lengths) + torch.tensor([len(o) for o in outputs]) - 1
        hidden = model(next_ids, positions, attn.step(seq_ids, [1] * len(prompts)))
        next_ids = model.compute_logits(hidden).argmax(-1)
        for out, t in zip(outputs, next_ids, strict=True):
            out.append(int(t))
    return outputs


@torch.inference_mode()
def transformers_greedy(hf_model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' greedy continuation of one prompt (its own KV cache, no eos stop)."""
    out = hf_model(torch.tensor([list(prompt)]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(max_new_tokens - 1):
        out = hf_model(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens
