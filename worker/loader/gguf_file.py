"""GGUF files (llama.cpp's format): metadata -> a Hugging Face config dict, tensors -> Hugging Face-named
float32 tensors (dequantized with `gguf.quants.dequantize`, see gguf_reader.py), vocabulary -> a
`tokenizers.Tokenizer`.

Everything leaves this module in Hugging Face shape, so the rest of the loader has one path.

llama.cpp's converter permutes the rows of Q and K for the "llama" architecture (it interleaves the
two RoPE halves of each head: rows `[head, half, i]` are stored as `[head, i, half]`); `_unpermute`
undoes it so the weights match the original checkpoint and the model's "rotate half" RoPE.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from kvpact.shared.errors import ModelLoadError
from kvpact.worker.loader.gguf_reader import GGUFContents, GGUFFormatError
from kvpact.worker.loader.gguf_tokenizer import build_tokenizer

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFFile:
    """An opened GGUF file (header parsed, tensor data memory-mapped and read only by `tensors()`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.contents = GGUFContents(path)
        except (GGUFFormatError, OSError) as e:
            raise ModelLoadError(
                f"{path}: not a readable GGUF file: {e}; it is corrupt or truncated — download it again"
            ) from e
        self.metadata = self.contents.metadata
        self.arch = str(self.value("general.architecture", ""))
        if self.arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: unsupported GGUF architecture {self.arch!r}; "
                f"kvpact supports {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.tensor_names = {t.name for t in self.contents.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def config_dict(self) -> dict[str, Any]:
        """The model's shape as a Hugging Face config.json dict."""
        a, v = self.arch, self.value
        if "rope_freqs.weight" in self.tensor_names:
            raise ModelLoadError(
                f"{self.path}: per-dimension RoPE frequencies (rope_freqs, Llama 3.1-style scaling in GGUF) "
                f"are not supported; use the model's Hugging Face directory instead"
            )
        hidden, heads = int(v(f"{a}.embedding_length")), int(v(f"{a}.attention.head_count"))
        tokens = v("tokenizer.ggml.tokens")
        config: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[a]],
            "hidden_size": hidden,
            "intermediate_size": v(f"{a}.feed_forward_length"),
            "num_hidden_layers": v(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": v(f"{a}.attention.head_count_kv", heads),
            "head_dim": v(f"{a}.attention.key_length", hidden // heads),
            "vocab_size": v(f"{a}.vocab_size", len(tokens) if tokens else None),
            "max_position_embeddings": v(f"{a}.context_length", 2048),
            "rms_norm_eps": _f32(v(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _f32(v(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            "bos_token_id": v("tokenizer.ggml.bos_token_id"),
            "eos_token_id": v("tokenizer.ggml.eos_token_id"),
            "hidden_act": "silu",
            "dtype": "float32",
        }
        scaling = v(f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            config["rope_scaling"] = {"rope_type": scaling, "factor": _f32(v(f"{a}.rope.scaling.factor"))}
        missing = [
            k for k, val in config.items() if val is None and k not in ("bos_token_id", "eos_token_id")
        ]
        if missing:
            raise ModelLoadError(
                f"{self.path}: GGUF metadata lacks {', '.join(missing)} for architecture {a!r}"
            )
        return config

    def weight_numel(self) -> int:
        return sum(t.num_elements for t in self.contents.tensors)

    def tensors(self, progress: Callable[[], None] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every tensor, dequantized and un-permuted."""
        config = self.config_dict()
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        for info in self.contents.tensors:
            name, kind = self._hf_name(info.name)
            try:
                array = self.contents.tensor(info)
            except NotImplementedError as e:
                raise ModelLoadError(
                    f"{self.path}: tensor {info.name!r} has type {info.qtype.name}, "
                    f"which the gguf package cannot dequantize"
                ) from e
            if self.arch == "llama" and kind in heads:
                array = _unpermute(array, heads[kind])
            if progress is not None:
                progress()
            yield name, torch.from_numpy(array if array.flags.writeable else array.copy())

    def tokenizer(self) -> tuple[Tokenizer, dict[str, Any]]:
        return build_tokenizer(self.metadata, str(self.path))

    def _hf_name(self, name: str) -> tuple[str, str]:
        """GGUF tensor name -> (Hugging Face name, GGUF kind such as "attn_q")."""
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _PER_LAYER:
            return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{parts[3]}", parts[2]
        if len(parts) == 2 and parts[0] in _TOP_LEVEL:
            return f"{_TOP_LEVEL[parts[0]]}.{parts[1]}", parts[0]
        raise ModelLoadError(f"{self.path}: unexpected tensor {name!r} for GGUF architecture {self.arch!r}")


def _f32(value: float | None) -> float | None:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return None if value is None else float(f"{value:.7g}")


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows `[head, i, half]` back to `[head, half, i]`."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
