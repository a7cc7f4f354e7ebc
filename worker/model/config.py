"""`ModelConfig`: the few numbers the Llama-family decoder needs, parsed from a Hugging Face config.json.

GGUF files are converted to the same dict first (worker/loader/gguf_file.py), so this is the one place
a model's shape is read and checked. Parsing is cheap (no weights): the worker calls it through
`kvpact.worker.loader.read_model_config` to fail fast before loading anything.

Both config.json spellings are accepted: transformers 5 writes `rope_parameters` (theta + scaling in
one dict), older files write `rope_theta` and `rope_scaling`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpact.shared.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# config.json written without `architectures` (e.g. a bare LlamaConfig) still names its model_type.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder's shape. `head_dim` sets the attention scale (`head_dim ** -0.5`).

    `rope_scaling` is None for plain RoPE, else a dict with `rope_type` ("linear" or "llama3") and that
    type's parameters. `attention_bias` is the q/k/v projection bias (Qwen2 has it, Llama only when
    its config says so); `attention_out_bias` the o_proj bias (Llama's `attention_bias` sets both).
    `sliding_window` is reported, not implemented: attention is full, which equals sliding-window
    attention only while a sequence is shorter than the window — the capability check names it.
    `dtype` is the checkpoint's stored dtype ("float32", "bfloat16", ...) or None when unstated.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    attention_out_bias: bool
    max_position_embeddings: int
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str | None = None

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config.json dict. Raises ModelLoadError naming `source` and the problem."""
        architecture = _architecture(d, source)
        need = _Required(d, source)
        hidden_size = need.integer("hidden_size")
        num_heads = need.integer("num_attention_heads")
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
        rope_theta, rope_scaling = _rope(d, source)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        llama_bias = bool(d.get("attention_bias", False)) and architecture == "LlamaForCausalLM"
        window = d.get("sliding_window")
        if is_qwen2 and not d.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=architecture,
            vocab_size=need.integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need.integer("intermediate_size"),
            num_layers=need.integer("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            attention_out_bias=llama_bias,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            sliding_window=int(window) if window else None,
            bos_token_id=_optional_int(d.get("bos_token_id")),
            eos_token_ids=_ids(d.get("eos_token_id")),
            dtype=_dtype_name(d.get("dtype") or d.get("torch_dtype")),
        )


def _architecture(d: Mapping[str, Any], source: str) -> str:
    names = list(d.get("architectures") or [])
    if not names and d.get("model_type") in _ARCHITECTURE_BY_MODEL_TYPE:
        names = [_ARCHITECTURE_BY_MODEL_TYPE[d["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    stated = ", ".join(names) or f"model_type {d.get('model_type')!r}"
    raise ModelLoadError(
        f"{source}: unsupported model architecture {stated}; "
        f"kvpact supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(d: Mapping[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from either config spelling; unknown scaling types are refused."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: RoPE scaling type {rope_type!r} is not supported; "
            f"kvpact supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    needed = (
        ("factor",)
        if rope_type == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    missing = [k for k in needed if merged.get(k) is None]
    if missing:
        raise ModelLoadError(f"{source}: RoPE scaling {rope_type!r} lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **{k: merged[k] for k in needed}}


class _Required:
    def __init__(self, d: Mapping[str, Any], source: str) -> None:
        self.d, self.source = d, source

    def integer(self, key: str) -> int:
        value = self.d.get(key)
        if value is None:
            raise ModelLoadError(f"{self.source}: required field {key!r} is missing")
        return int(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")
